"""The ``twinkle`` command line.

Each top-level command is one entry in ``COMMANDS``: a function that adds its parser (and its
sub-actions) to the ``twinkle`` parser. Each action is a function ``(args) -> exit code``
attached with ``set_defaults(run=...)``. To add a command, write its ``add_*_parser`` and its
action functions, and list it in ``COMMANDS``.

    twinkle assets list
    twinkle assets model [NAME]
    twinkle assets dataset NAME [--split SPLIT] [--out FILE]   (an image dataset: its images beside FILE)
    twinkle export CHECKPOINT [--merge] [--base MODEL] --out DIR [--push-to-hub hf://org/name]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from twinkle.errors import TwinkleError

# argparse exposes no public name for this type; a string, as the class is generic only in typeshed.
Subparsers: TypeAlias = 'argparse._SubParsersAction[argparse.ArgumentParser]'


# --- twinkle assets ------------------------------------------------------------------------------


def assets_list(args: argparse.Namespace) -> int:
    """Print the embedded model and dataset names (with their splits)."""
    from twinkle.assets import DATASETS, MODELS
    from twinkle.assets.data import dataset_splits

    print('models:')
    for name in MODELS:
        print(f'  {name}')
    print('datasets:')
    for name in DATASETS:
        print(f'  {name} (splits: {", ".join(dataset_splits(name))})')
    return 0


def assets_model(args: argparse.Namespace) -> int:
    """Build model ``args.name`` if needed and print its folder."""
    from twinkle.assets import tiny_model

    print(tiny_model(args.name))
    return 0


def assets_dataset(args: argparse.Namespace) -> int:
    """Build dataset ``args.name`` if needed; print its file, or copy it to ``args.out``.

    An image dataset's rows name their pictures by paths relative to the JSONL's folder, so the
    copy brings them along: each picture a row names lands at the same relative path beside
    ``args.out``, and the copied rows stay byte-identical. A copy is then a folder the user owns,
    that can move or be shared whole; absolute paths into the cache would break when it is cleared
    or the file leaves this machine."""
    from twinkle.assets import dataset

    path = Path(dataset(args.name, args.split))
    if args.out is None:
        print(path)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, args.out)
    for relative in image_files(path):
        target = args.out.parent / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path.parent / relative, target)
    print(args.out)
    return 0


def image_files(jsonl: Path) -> list[str]:
    """The relative image paths the rows of ``jsonl`` name (Qwen-VL image parts), in row order, once each."""
    seen: dict[str, None] = {}
    for line in filter(str.strip, jsonl.read_text(encoding='utf-8').splitlines()):
        for message in json.loads(line).get('messages') or []:
            content = message.get('content')
            for part in content if isinstance(content, list) else []:
                image = part.get('image') if part.get('type') == 'image' else None
                if isinstance(image, str) and not Path(image).is_absolute():
                    seen[image] = None
    return list(seen)


def add_assets_parser(commands: Subparsers) -> None:
    """``twinkle assets {list,model,dataset}``: the embedded models and datasets."""
    assets = commands.add_parser('assets', help='embedded tiny models and datasets (built locally)')
    actions = assets.add_subparsers(dest='action', required=True, metavar='ACTION')

    listing = actions.add_parser('list', help='print the embedded model and dataset names')
    listing.set_defaults(run=assets_list)

    model = actions.add_parser('model', help='build a model if needed and print its folder')
    model.add_argument('name', nargs='?', default='tiny-qwen3', help='model name (default: tiny-qwen3)')
    model.set_defaults(run=assets_model)

    data = actions.add_parser('dataset', help='build a dataset if needed and print its JSONL file')
    data.add_argument('name', help='dataset name, see `twinkle assets list`')
    data.add_argument('--split', default='train', help='split name (default: train)')
    data.add_argument(
        '--out', type=Path, default=None, help="write a copy of the file here (an image dataset's images beside it)"
    )
    data.set_defaults(run=assets_dataset)


# --- twinkle export ------------------------------------------------------------------------------


def export(args: argparse.Namespace) -> int:
    """Write a checkpoint as a merged Hugging Face model (``--merge``) or as its peft adapter."""
    from twinkle.model.checkpoint.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, merge=args.merge, base_model=args.base, dtype=args.dtype)
    print(out)
    if args.push_to_hub:
        from twinkle.model.checkpoint.export import push_to_hub

        print(push_to_hub(out, args.push_to_hub, private=not args.public))
    return 0


def add_export_parser(commands: Subparsers) -> None:
    """``twinkle export CHECKPOINT [--merge] --out DIR``: trained weights in a form other tools load."""
    from twinkle.model.checkpoint.export import DTYPES

    parser = commands.add_parser(
        'export',
        help='write a checkpoint as a merged Hugging Face model (--merge) or a peft adapter',
        description='Write CHECKPOINT (a folder model.save wrote) to --out: with --merge the base model with '
        "the adapter merged in (safetensors, config, tokenizer; plain transformers loads it as the base's class), "
        "without it the peft adapter and tokenizer, less the training state. A vision-language base's "
        'processor files (image and video processors, chat template) are kept in either.',
    )
    parser.add_argument('checkpoint', help='the checkpoint folder')
    parser.add_argument('--out', required=True, type=Path, help='a new or empty folder to write')
    parser.add_argument('--merge', action='store_true', help='merge the adapter into its base model')
    parser.add_argument(
        '--base',
        default=None,
        help='the base model to merge into, and whose processor files to keep (default: the adapter names it)',
    )
    parser.add_argument('--dtype', default='auto', choices=list(DTYPES), help="merged weights' type (default: auto)")
    parser.add_argument(
        '--push-to-hub', metavar='HUB_ID', help='then upload the folder to hf://org/name or ms://org/name'
    )
    parser.add_argument('--public', action='store_true', help='a new hub repository is public (default: private)')
    parser.set_defaults(run=export)


# --- the command table and entry point -----------------------------------------------------------

COMMANDS: dict[str, Callable[[Subparsers], None]] = {
    'assets': add_assets_parser,
    'export': add_export_parser,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``twinkle`` parser with every command in ``COMMANDS``."""
    parser = argparse.ArgumentParser(prog='twinkle', description='Post-training for large language models.')
    commands = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    for add_parser in COMMANDS.values():
        add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); return the exit code.

    Errors twinkle raises on purpose (an unknown name, a bad split) print one line to stderr
    and exit with 2, like argparse's own usage errors.
    """
    args = build_parser().parse_args(argv)
    try:
        run: Callable[[argparse.Namespace], int] = args.run  # set_defaults(run=...) of the chosen action
        return run(args)
    except TwinkleError as error:
        print(f'twinkle: error: {error}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())

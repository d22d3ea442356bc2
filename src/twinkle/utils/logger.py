from __future__ import annotations

import logging
import os

_FORMAT = '[%(levelname)s:%(name)s] %(message)s'


def get_logger(log_file: str | None = None, log_level: int | str | None = None) -> logging.Logger:
    """The ``twinkle`` logger: INFO by default (``LOG_LEVEL`` overrides), to stderr and, if
    given, to ``log_file`` as well."""
    logger = logging.getLogger('twinkle')
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
    level = log_level or os.environ.get('LOG_LEVEL', 'INFO')
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    if log_file and not any(getattr(h, 'baseFilename', None) == os.path.abspath(log_file) for h in logger.handlers):
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(logging.Formatter('%(asctime)s ' + _FORMAT))
        logger.addHandler(file_handler)
    return logger

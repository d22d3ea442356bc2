"""How the work of one model splits across ranks: experts (expert parallel) and sequences (Ulysses)."""

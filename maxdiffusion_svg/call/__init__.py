"""One SVG call on one device: ``prepare`` (static decisions, once) and ``svg_attention``."""

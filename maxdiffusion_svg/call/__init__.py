"""One SVG call on one device: ``prepare`` (every static decision, once) and ``svg_attention``
(route -> place -> sparse kernel -> restore)."""

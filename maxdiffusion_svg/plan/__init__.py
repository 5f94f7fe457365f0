"""The static plan of a call: the token grid and orders, the SVG masks, the tile tables,
and the target hardware's tile sizes (NumPy, at trace time, in O(tiles))."""

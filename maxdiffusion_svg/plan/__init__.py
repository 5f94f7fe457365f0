"""A call's static plan (NumPy, at trace time, O(tiles)): token grid, masks, tiles, target."""

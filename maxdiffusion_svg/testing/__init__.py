"""Test fixtures that stand in for Wan's weights: a tiny random transformer built by
MaxDiffusion's own factories (``tiny_wan``) and a tiny checkpoint the stock ``generate_wan``
loads offline (``tiny_checkpoint``).

Like ``plugin``, these import MaxDiffusion; unlike it, nothing here runs in a user's job.
"""

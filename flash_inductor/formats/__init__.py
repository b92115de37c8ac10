"""Storage formats: the one place where the project's numerics are defined.

Every encode/decode here is a pure function of torch ops, so the same code runs eagerly, inside
graphs the passes rewrite (Inductor fuses it into the optimizer update), and in checkpoint
conversion.
"""

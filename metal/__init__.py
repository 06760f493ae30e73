"""The Metal kernel bodies (`*.metal`), installed as the data package `cortexstream.kernels.metal`.

pyproject.toml maps this folder into the package at build time; this file makes it a regular package so an
editable install finds it by name as well (setuptools' editable finder does not resolve a folder without one
nested under a regular package). `cortexstream.kernels.launch.metal_dir()` locates the sources through it.
"""

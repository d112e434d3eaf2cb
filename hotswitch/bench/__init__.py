"""Benchmarks behind `hotswitch bench`: `switch` (every switch between configs vs DTensor and DCP),
`train` (hot switching vs the best static config), `elastic` (a change of devices three ways)."""

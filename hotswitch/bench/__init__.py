"""Benchmarks behind `hotswitch bench`: `switch` (every switch between configs vs DTensor and DCP),
`train` (hot switching vs the best static config), `elastic` (a change of devices three ways), `cp`
(context-parallel layouts on skewed batches), `step` (one training step vs DDP and DTensor TP), `gpu`
(one GPU rank); `common` holds what they share."""

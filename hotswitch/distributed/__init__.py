"""Processes and process groups: `launch` (run a function on N local processes in one group, as
torchrun would), `netns` (emulated nodes in network namespaces), `_c10d` (private c10d calls)."""

"""What a run costs before it is paid for: the planner, the published memory
formulas, FLOP counts, and the rehearsal of large launches over a fake
process group."""

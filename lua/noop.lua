-- Does nothing: the benchmark's baseline for the cost of one EVALSHA round trip.
return 1

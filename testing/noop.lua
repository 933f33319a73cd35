-- Does nothing: the benchmarks' baseline for the cost of one EVALSHA round trip
-- (loaded by benchmarks/_common.noop; production backends never register it).
return 1

-- committed + in-flight of each counter in KEYS, read in one round trip.
local out = {}
for i = 1, #KEYS do
  out[i] = used_of(KEYS[i])
end
return out

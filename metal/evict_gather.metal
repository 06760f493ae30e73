// Eviction gather (kernel a): the kept tokens of one layer, K and V in one launch, per KV head.
//
//   out_keys[h, i, :]   = keys[h, slot(keep[h, i]), :]
//   out_values[h, i, :] = values[h, slot(keep[h, i]), :]
//   slot(t) = table[t / BS] * BS + t % BS      (logical token position -> arena slot via the block table)
//
// The caller then writes the rows to the front of the sequence (positions 0..n-1): that is the compaction.
// Inputs:  keys [H, S, DK], values [H, S, DV] (the whole arena buffers of one layer, no copy),
//          table [num_blocks] int32, keep [H, n] int32 (sorted logical positions, per KV head).
// Outputs: out_keys [H, n, DK], out_values [H, n, DV].
// Template: T (arena dtype), BS (block size). Grid (max(DK, DV), n, H): one thread per output element pair,
// so consecutive threads read consecutive elements of one row (coalesced). No barriers, no simdgroup ops.
const int d = int(thread_position_in_grid.x);
const int i = int(thread_position_in_grid.y);
const int h = int(thread_position_in_grid.z);
const int num_slots = keys_shape[1];
const int dk = keys_shape[2];
const int dv = values_shape[2];
const int n = keep_shape[1];
const int t = keep[h * n + i];
const int64_t slot = int64_t(table[t / BS]) * BS + t % BS;
const int64_t src = int64_t(h) * num_slots + slot;
const int64_t dst = int64_t(h) * n + i;
if (d < dk) {
  out_keys[dst * dk + d] = keys[src * dk + d];
}
if (d < dv) {
  out_values[dst * dv + d] = values[src * dv + d];
}

// Compression gather + first layer (kernel b): group F consecutive tokens, then Linear(F*D -> DO) + ReLU.
//
//   x[h, g, j * D + d] = buf[h, slot(start + g * F + j), d]                       (the grouped gather)
//   out[h, g, o]       = max(0, b1[o] + sum_{c < F*D} w1[o, c] * x[h, g, c])      (PyTorch Linear layout)
//   slot(t) = table[t / BS] * BS + t % BS
//
// The gathered groups never exist in memory: each thread reads its group's F arena rows straight through the
// block table. Accumulation is float32 whatever T and TW are.
// Inputs:  buf [H, S, D], table [num_blocks] int32, start (0-d int32), w1 [DO, F * D], b1 [DO].
// Outputs: out [H, G, DO] (dtype TW).
// Template: T (arena dtype), TW (weight dtype), F (group size), BS (block size).
// Grid (DO, G, H), one thread per output feature. This is the simple, barrier-free form: every thread re-reads
// the group's rows (they stay in cache across the DO threads of a threadgroup) and walks its own row of w1.
const int o = int(thread_position_in_grid.x);
const int g = int(thread_position_in_grid.y);
const int h = int(thread_position_in_grid.z);
const int num_slots = buf_shape[1];
const int dim = buf_shape[2];
const int out_dim = w1_shape[0];
const int groups = int(threads_per_grid.y);
const int64_t wrow = int64_t(o) * (F * dim);
float acc = float(b1[o]);
for (int j = 0; j < F; ++j) {
  const int t = start + g * F + j;
  const int64_t src = (int64_t(h) * num_slots + int64_t(table[t / BS]) * BS + t % BS) * dim;
  const int64_t wcol = wrow + int64_t(j) * dim;
  for (int d = 0; d < dim; ++d) {
    acc += float(w1[wcol + d]) * float(buf[src + d]);
  }
}
out[(int64_t(h) * groups + g) * out_dim + o] = static_cast<TW>(metal::max(acc, 0.0f));

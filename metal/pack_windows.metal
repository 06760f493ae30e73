// Sidecar window packing (kernel b, no matmul): W consecutive tokens of a sequence side by side.
//
//   out[h, g, j * D + d] = buf[h, slot(start + g * W + j), d]      for j < W, d < D
//   slot(t) = table[t / BS] * BS + t % BS
//
// Inputs:  buf [H, S, D] (one layer's arena buffer), table [num_blocks] int32, start (0-d int32: first position).
// Outputs: out [H, G, W * D].
// Template: T (arena dtype), W (window), BS (block size). Grid (W * D, G, H), one thread per output element;
// G is read back from threads_per_grid.y (MLX dispatches exactly the grid it is given).
const int e = int(thread_position_in_grid.x);
const int g = int(thread_position_in_grid.y);
const int h = int(thread_position_in_grid.z);
const int num_slots = buf_shape[1];
const int dim = buf_shape[2];
const int groups = int(threads_per_grid.y);
const int j = e / dim;
const int d = e % dim;
const int t = start + g * W + j;
const int64_t slot = int64_t(table[t / BS]) * BS + t % BS;
out[(int64_t(h) * groups + g) * (W * dim) + e] = buf[(int64_t(h) * num_slots + slot) * dim + d];

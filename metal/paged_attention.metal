// Paged decode attention (kernel c) with the H2O column sums fused in (kernel d, when COLSUM).
//
// One threadgroup per (sequence b, KV head): it serves all G query heads that share the KV head (GQA), so each
// K/V row is read from the arena once, through the block table, with no gathered copy. The threadgroup is NSG
// simdgroups of 32 lanes; simdgroup s takes positions t = s, s + NSG, s + 2 NSG, ... of the sequence. Within a
// simdgroup lane l holds elements d = l, l + 32, ... of q, k, v (coalesced row reads); q.k is a simd_sum.
// Each simdgroup keeps a running max / sum / weighted V per query head (online softmax); the NSG partial results
// are merged through threadgroup memory at the end.
//
//   out[b, j, :] = softmax_t(scale * q[b, j] . k[slot(t)]) @ v[slot(t)],  t < lengths[b], j = kvh * G + jj
//   colsum[b, kvh, t] = sum_jj p[b, kvh * G + jj, t]  (attention each cached token received; 0 for t >= length)
//   slot(t) = tables[b, t / BS] * BS + t % BS
//
// Inputs:  queries [B, Hq, D] (TQ), keys [Hkv, S, D], values [Hkv, S, DV] (T; one layer's arena buffers),
//          tables [B, MB] int32, lengths [B] int32, scale (0-d float32).
// Outputs: out [B, Hq, DV] (TQ); colsum [B, Hkv, MB * BS] float32; scores [B, Hq, MB * BS] float32 scratch
//          (raw scores, re-read by the same thread that wrote them). Both are [1] and untouched unless COLSUM.
// Template: TQ, T, G (query heads per KV head), D, DV, BS, NSG (simdgroups per threadgroup), COLSUM (bool).
// Grid (32 * NSG, Hkv, B), threadgroup (32 * NSG, 1, 1). A sequence of length 0 gives zeros.
// Control flow is uniform per simdgroup up to every simd_sum and per threadgroup up to every barrier.
// No infinities are used (NEG is a finite sentinel), so the result does not depend on the math mode.
constexpr int QPL = (D + 31) / 32;
constexpr int VPL = (DV + 31) / 32;
constexpr float NEG = -3.0e38f;
// Threadgroup memory, NSG * (DV + 2) floats (4.1 KB at NSG 8, DV 128), declared at function scope.
threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
threadgroup float tg_acc[NSG * DV];
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int kvh = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int num_kv_heads = keys_shape[0];
const int num_slots = keys_shape[1];
const int max_blocks = tables_shape[1];
const int span = max_blocks * BS;
const int num_q_heads = num_kv_heads * G;
const int length = lengths[b];

float q[G][QPL];
float acc[G][VPL];
float m[G];
float l[G];
for (int j = 0; j < G; ++j) {
  const int64_t qrow = (int64_t(b) * num_q_heads + kvh * G + j) * D;
  for (int i = 0; i < QPL; ++i) {
    const int d = lane + 32 * i;
    q[j][i] = d < D ? float(queries[qrow + d]) * scale : 0.0f;
  }
  for (int i = 0; i < VPL; ++i) {
    acc[j][i] = 0.0f;
  }
  m[j] = NEG;
  l[j] = 0.0f;
}

for (int t = sg; t < length; t += NSG) {
  const int64_t row = int64_t(kvh) * num_slots + int64_t(tables[b * max_blocks + t / BS]) * BS + t % BS;
  float k[QPL];
  float v[VPL];
  for (int i = 0; i < QPL; ++i) {
    const int d = lane + 32 * i;
    k[i] = d < D ? float(keys[row * D + d]) : 0.0f;
  }
  for (int i = 0; i < VPL; ++i) {
    const int d = lane + 32 * i;
    v[i] = d < DV ? float(values[row * DV + d]) : 0.0f;
  }
  for (int j = 0; j < G; ++j) {
    float part = 0.0f;
    for (int i = 0; i < QPL; ++i) {
      part += q[j][i] * k[i];
    }
    const float s = simd_sum(part);
    if (COLSUM && lane == (t / NSG) % 32) {
      scores[(int64_t(b) * num_q_heads + kvh * G + j) * span + t] = s;
    }
    const float m_new = metal::max(m[j], s);
    const float factor = metal::exp(m[j] - m_new);
    const float p = metal::exp(s - m_new);
    l[j] = l[j] * factor + p;
    for (int i = 0; i < VPL; ++i) {
      acc[j][i] = acc[j][i] * factor + p * v[i];
    }
    m[j] = m_new;
  }
}

// Merge the NSG partial softmaxes, one query head at a time, through tg_m / tg_l / tg_acc.
const int tid = sg * 32 + lane;
float final_m[G];
float final_l[G];
for (int j = 0; j < G; ++j) {
  if (lane == 0) {
    tg_m[sg] = m[j];
    tg_l[sg] = l[j];
  }
  for (int i = 0; i < VPL; ++i) {
    const int d = lane + 32 * i;
    if (d < DV) {
      tg_acc[sg * DV + d] = acc[j][i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float big = NEG;
  for (int s = 0; s < NSG; ++s) {
    big = metal::max(big, tg_m[s]);
  }
  float total = 0.0f;
  for (int s = 0; s < NSG; ++s) {
    total += tg_l[s] * metal::exp(tg_m[s] - big);
  }
  const int64_t orow = (int64_t(b) * num_q_heads + kvh * G + j) * DV;
  for (int d = tid; d < DV; d += 32 * NSG) {
    float o = 0.0f;
    for (int s = 0; s < NSG; ++s) {
      o += tg_acc[s * DV + d] * metal::exp(tg_m[s] - big);
    }
    out[orow + d] = static_cast<TQ>(total > 0.0f ? o / total : 0.0f);
  }
  final_m[j] = big;
  final_l[j] = total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

if (COLSUM) {
  // Thread (sg, lane) wrote the scores of t = sg + NSG * k for k % 32 == lane; it re-reads exactly those.
  for (int t = sg + NSG * lane; t < span; t += NSG * 32) {
    float c = 0.0f;
    if (t < length) {
      for (int j = 0; j < G; ++j) {
        c += metal::exp(scores[(int64_t(b) * num_q_heads + kvh * G + j) * span + t] - final_m[j]) / final_l[j];
      }
    }
    colsum[(int64_t(b) * num_kv_heads + kvh) * span + t] = c;
  }
}

// metal_shim.h: just enough of the Metal Shading Language, as C++17, to compile CortexStream's kernel bodies
// (metal/*.metal) on a machine without Metal and run them on the CPU. Only what the bodies use is defined.
//
// - Address spaces (metal_keywords.h): `device` and `constant` are erased; `threadgroup` becomes `static`, which
//   gives one array shared by every thread of a threadgroup, because the driver runs threadgroups one after
//   another. It is only valid on array declarations, never as a pointer qualifier (the bodies respect that).
// - Types: uint, uint3, float16_t (_Float16), bfloat16_t (round-to-nearest-even struct), metal::exp/max/min.
// - Collectives: simd_sum and threadgroup_barrier are real rendezvous between the OS threads that stand in for
//   the GPU threads of one threadgroup (driver.cpp spawns them). A collective completes only when every thread of
//   its scope arrives at the same kind of collective; a thread that returns while its siblings wait, or two
//   different collectives meeting, aborts the run: that is divergent control flow, undefined on the GPU.
// What this cannot show: Metal compiles the text (the shim accepts some C++ Metal rejects and vice versa), real
// simdgroup timing and memory ordering, performance. See metal/README.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};

typedef _Float16 float16_t;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // NOLINT: implicit, like Metal's bfloat
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40);  // quiet NaN
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace metal {
inline float exp(float x) { return std::exp(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
}  // namespace metal

namespace cs {
// The collectives are defined in driver.cpp: a rendezvous of the OS threads standing in for a simdgroup or a
// threadgroup (see the comment at the top of this file).
float simd_sum_impl(float x);
void threadgroup_barrier_impl();
}  // namespace cs

inline float simd_sum(float x) { return cs::simd_sum_impl(x); }
inline void threadgroup_barrier(metal::mem_flags) { cs::threadgroup_barrier_impl(); }

using namespace metal;  // MLX's generated kernels see metal:: names unqualified too

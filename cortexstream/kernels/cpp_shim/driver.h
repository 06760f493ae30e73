// driver.h: the interface a generated kernel program uses to load its inputs, launch the body over a grid, and
// save its outputs. The implementation (driver.cpp) is compiled once and linked into every kernel program, so
// the per-kernel compile only sees this light header.
//
// Launch semantics follow Metal's dispatchThreads (what MLX uses): only threads inside the grid exist and edge
// threadgroups are truncated. I/O: argv[1] is a folder with meta.txt (written by runner.py) and the raw row-major
// bytes of each input (in<i>.bin); outputs are written as out<i>.bin. argv[2] is the order threadgroups (and,
// without collectives, threads) run in: 0 forward, 1 reverse; results must not depend on it. Every input lives in
// its own heap block of exactly its size, so AddressSanitizer reports any read outside an input; every output
// starts as 0xFF bytes (NaN for floats), so an element the kernel forgets to write shows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "metal_shim.h"

namespace cs {

template <typename T>
struct Buffer {
  T* data = nullptr;
  std::vector<int> shape;
  std::vector<int64_t> strides;
  int ndim = 0;
};

// Every attribute driver.cpp can give a body (runner.py's EMULATED list).
struct Thread {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_grid, threads_per_threadgroup, threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint threads_per_simdgroup;
};

using BodyFn = void (*)(const Thread&, void*);

class Run {
 public:
  Run(int argc, char** argv);
  ~Run();

  template <typename T>
  Buffer<T> input(int i) {
    return typed<T>(load_input(i, sizeof(T)), input_shape(i));
  }

  template <typename T>
  Buffer<T> output(int i) {
    return typed<T>(make_output(i, sizeof(T)), output_shape(i));
  }

  // Runs `body(thread)` for every thread of the grid. With `cooperative`, a threadgroup's threads are OS threads
  // meeting at simd_sum / threadgroup_barrier; otherwise they run one after another.
  template <typename Body>
  void launch(bool cooperative, Body& body) {
    launch_raw(cooperative, [](const Thread& t, void* f) { (*static_cast<Body*>(f))(t); }, &body);
  }

  void save();

 private:
  template <typename T>
  static Buffer<T> typed(void* data, const std::vector<int>& shape) {
    Buffer<T> buf;
    buf.data = static_cast<T*>(data);
    buf.shape = shape;
    buf.ndim = int(shape.size());
    buf.strides.assign(shape.size(), 1);
    for (int d = buf.ndim - 2; d >= 0; --d) buf.strides[d] = buf.strides[d + 1] * shape[d + 1];
    return buf;
  }

  void* load_input(int i, size_t itemsize);
  void* make_output(int i, size_t itemsize);
  const std::vector<int>& input_shape(int i) const;
  const std::vector<int>& output_shape(int i) const;
  void launch_raw(bool cooperative, BodyFn body, void* context);

  struct State;
  State* state_;
};

}  // namespace cs

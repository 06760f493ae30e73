// driver.cpp: implementation of driver.h (I/O, the dispatchThreads-style launcher) and of the simdgroup /
// threadgroup collectives declared in metal_shim.h. Compiled once per compiler flags and linked into every
// kernel program.
#include "driver.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

namespace cs {
namespace {

constexpr int kSimdWidth = 32;  // every Apple GPU so far
constexpr uint kMaxThreadsPerThreadgroup = 1024;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "metal_shim: %s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(3);
}

// Bookkeeping shared by all collectives of one threadgroup, under one mutex: how many of its threads are still
// running the body and how many are blocked in a collective. If every live thread is blocked and none of the
// collectives can complete, the launch would hang on a GPU too: report it at once.
struct GroupState {
  std::mutex mu;
  int live = 0;
  int blocked = 0;

  void check_deadlock(const std::string& op) {
    if (live > 0 && blocked == live) {
      fail(op + ": deadlock, every thread waits at a collective that cannot complete "
                "(threads of one simdgroup/threadgroup reached different collectives)");
    }
  }
};

// A rendezvous of `size` threads (a simdgroup or a whole threadgroup). It completes only when every thread of
// the scope arrives at the same kind of collective; values are summed in lane order, so results are deterministic.
class Rendezvous {
 public:
  Rendezvous(GroupState& group, int size) : group_(group), size_(size), values_(size) {}

  float arrive(const char* op, int lane, float value) {
    std::unique_lock<std::mutex> lock(group_.mu);
    if (exited_ > 0) fail(std::string(op) + ": a thread of this scope already returned (divergent control flow)");
    if (arrived_ == 0) {
      op_ = op;
    } else if (op_ != op) {
      fail(std::string(op) + " met " + op_ + ": threads of one scope reached different collectives");
    }
    values_[lane] = value;
    const uint64_t generation = generation_;
    if (++arrived_ == size_) {
      float total = 0.0f;
      for (float v : values_) total += v;
      result_ = total;
      group_.blocked -= size_ - 1;  // the waiters this completion releases
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    ++group_.blocked;
    group_.check_deadlock(op);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (generation_ == generation) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation) {
        fail(std::string(op) + ": the scope never completed in 120 s");
      }
    }
    return result_;  // stable until the next round completes, which needs this thread too
  }

  // Called (under group_.mu) when a thread of this scope returns from the body.
  void exit_locked() {
    ++exited_;
    if (arrived_ > 0) fail(op_ + ": a thread returned while others wait (divergent control flow)");
  }

 private:
  GroupState& group_;
  std::condition_variable cv_;
  const int size_;
  int arrived_ = 0;
  int exited_ = 0;
  uint64_t generation_ = 0;
  std::string op_;
  std::vector<float> values_;
  float result_ = 0.0f;
};

struct ThreadScopes {
  Rendezvous* simdgroup = nullptr;
  Rendezvous* threadgroup = nullptr;
  int lane = 0;
  int index_in_threadgroup = 0;
};
thread_local ThreadScopes current;

struct Spec {
  size_t itemsize = 0;
  std::vector<int> shape;
  size_t count() const {
    size_t n = 1;
    for (int d : shape) n *= size_t(d);
    return n;
  }
};

uint ceil_div(uint a, uint b) { return (a + b - 1) / b; }

}  // namespace

float simd_sum_impl(float x) {
  if (current.simdgroup == nullptr) fail("simd_sum outside a cooperative launch");
  return current.simdgroup->arrive("simd_sum", current.lane, x);
}

void threadgroup_barrier_impl() {
  if (current.threadgroup == nullptr) fail("threadgroup_barrier outside a cooperative launch");
  current.threadgroup->arrive("threadgroup_barrier", current.index_in_threadgroup, 0.0f);
}

struct Run::State {
  std::string dir;
  bool reverse = false;
  uint3 grid{0, 0, 0};
  uint3 group{0, 0, 0};
  std::vector<Spec> inputs, outputs;
  std::vector<std::pair<void*, size_t>> written;
  std::vector<void*> blocks;

  void* hold(size_t bytes) {  // one exact-size heap block per array, so ASan sees every overrun
    void* p = std::malloc(bytes);
    if (bytes != 0 && p == nullptr) fail("out of memory");
    blocks.push_back(p);
    return p;
  }
};

Run::Run(int argc, char** argv) : state_(new State) {
  if (argc < 3) fail("usage: kernel <folder> <order>");
  State& s = *state_;
  s.dir = argv[1];
  s.reverse = std::atoi(argv[2]) != 0;
  std::ifstream meta(s.dir + "/meta.txt");
  if (!meta) fail("cannot read meta.txt");
  std::string line;
  while (std::getline(meta, line)) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "grid") in >> s.grid.x >> s.grid.y >> s.grid.z;
    if (key == "threadgroup") in >> s.group.x >> s.group.y >> s.group.z;
    if (key == "input" || key == "output") {
      int index = 0, ndim = 0;
      Spec spec;
      in >> index >> spec.itemsize >> ndim;
      spec.shape.resize(ndim);
      for (int& d : spec.shape) in >> d;
      auto& list = key == "input" ? s.inputs : s.outputs;
      if (int(list.size()) != index) fail("meta.txt: inputs/outputs out of order");
      list.push_back(spec);
    }
  }
  if (s.group.x * s.group.y * s.group.z == 0) fail("meta.txt: empty threadgroup");
  if (s.group.x * s.group.y * s.group.z > kMaxThreadsPerThreadgroup) fail("threadgroup over 1024 threads");
}

Run::~Run() {
  for (void* p : state_->blocks) std::free(p);
  delete state_;
}

const std::vector<int>& Run::input_shape(int i) const { return state_->inputs.at(i).shape; }
const std::vector<int>& Run::output_shape(int i) const { return state_->outputs.at(i).shape; }

void* Run::load_input(int i, size_t itemsize) {
  const Spec& spec = state_->inputs.at(i);
  if (spec.itemsize != itemsize) fail("input " + std::to_string(i) + ": dtype size differs from the kernel's");
  const size_t bytes = spec.count() * itemsize;
  void* data = state_->hold(bytes);
  std::ifstream file(state_->dir + "/in" + std::to_string(i) + ".bin", std::ios::binary);
  if (!file.read(static_cast<char*>(data), std::streamsize(bytes))) fail("short input file " + std::to_string(i));
  return data;
}

void* Run::make_output(int i, size_t itemsize) {
  const Spec& spec = state_->outputs.at(i);
  if (spec.itemsize != itemsize) fail("output " + std::to_string(i) + ": dtype size differs from the kernel's");
  const size_t bytes = spec.count() * itemsize;
  void* data = state_->hold(bytes);
  std::memset(data, 0xFF, bytes);
  state_->written.push_back({data, bytes});
  return data;
}

void Run::save() {
  for (size_t i = 0; i < state_->written.size(); ++i) {
    std::ofstream file(state_->dir + "/out" + std::to_string(i) + ".bin", std::ios::binary);
    file.write(static_cast<const char*>(state_->written[i].first), std::streamsize(state_->written[i].second));
    if (!file) fail("cannot write output " + std::to_string(i));
  }
}

static void run_cooperative(const std::vector<Thread>& threads, bool reverse, BodyFn body, void* context) {
  const int n = int(threads.size());
  GroupState state;
  state.live = n;
  Rendezvous group(state, n);
  std::vector<std::unique_ptr<Rendezvous>> simdgroups;
  for (int s = 0; s * kSimdWidth < n; ++s) {
    simdgroups.push_back(std::make_unique<Rendezvous>(state, std::min(kSimdWidth, n - s * kSimdWidth)));
  }
  std::vector<std::thread> workers;
  workers.reserve(n);
  for (int i = 0; i < n; ++i) {
    const int t = reverse ? n - 1 - i : i;
    workers.emplace_back([&, t] {
      current.threadgroup = &group;
      current.simdgroup = simdgroups[t / kSimdWidth].get();
      current.lane = t % kSimdWidth;
      current.index_in_threadgroup = t;
      body(threads[t], context);
      std::lock_guard<std::mutex> lock(state.mu);
      current.simdgroup->exit_locked();
      group.exit_locked();
      --state.live;
      state.check_deadlock("return");
    });
  }
  for (auto& w : workers) w.join();
}

void Run::launch_raw(bool cooperative, BodyFn body, void* context) {
  const State& s = *state_;
  const uint3 groups = {ceil_div(s.grid.x, s.group.x), ceil_div(s.grid.y, s.group.y), ceil_div(s.grid.z, s.group.z)};
  const uint total = groups.x * groups.y * groups.z;
  for (uint n = 0; n < total; ++n) {
    const uint g = s.reverse ? total - 1 - n : n;
    const uint3 gpos = {g % groups.x, (g / groups.x) % groups.y, g / (groups.x * groups.y)};
    const uint3 size = {std::min(s.group.x, s.grid.x - gpos.x * s.group.x),
                        std::min(s.group.y, s.grid.y - gpos.y * s.group.y),
                        std::min(s.group.z, s.grid.z - gpos.z * s.group.z)};
    const int count = int(size.x * size.y * size.z);
    std::vector<Thread> threads(count);
    for (int t = 0; t < count; ++t) {
      const uint3 local = {uint(t) % size.x, (uint(t) / size.x) % size.y, uint(t) / (size.x * size.y)};
      Thread& th = threads[t];
      th.thread_position_in_threadgroup = local;
      th.threadgroup_position_in_grid = gpos;
      th.thread_position_in_grid = {gpos.x * s.group.x + local.x, gpos.y * s.group.y + local.y,
                                    gpos.z * s.group.z + local.z};
      th.threads_per_grid = s.grid;
      th.threads_per_threadgroup = size;
      th.threadgroups_per_grid = groups;
      th.thread_index_in_threadgroup = uint(t);
      th.thread_index_in_simdgroup = uint(t % kSimdWidth);
      th.simdgroup_index_in_threadgroup = uint(t / kSimdWidth);
      th.threads_per_simdgroup = kSimdWidth;
    }
    if (cooperative) {
      run_cooperative(threads, s.reverse, body, context);
    } else {
      for (int t = 0; t < count; ++t) body(threads[s.reverse ? count - 1 - t : t], context);
    }
  }
}

}  // namespace cs

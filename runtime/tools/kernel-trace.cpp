//===- kernel-trace.cpp - Every kernel's GPU start and end, through CUPTI -===//
//
// A library to preload into any CUDA program (loom-run, a gtest, PyTorch):
//
//   LOOM_KERNEL_TRACE=k.csv LD_PRELOAD=build/runtime/libloom-kernel-trace.so loom-run B.loom ...
//
// It asks CUPTI for the concurrent-kernel, memcpy and memset activity records
// and writes one CSV line per record when the program exits: kind, device,
// stream, start and end in ns (one clock for every GPU), grid and block sizes
// (kernels) or bytes (copies), and the name. Unlike `loom-run --trace`, which
// puts an event pair around every instruction and runs eagerly, this sees the
// steady state: kernels replayed from CUDA graphs, NCCL's kernels on their own
// stream, and which of them ran at the same time. bench/kernel_timeline.py
// reads the file.
//
//===----------------------------------------------------------------------===//

#include <cupti.h>

#include <cxxabi.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

std::mutex mutex;
FILE *out = nullptr;
size_t records = 0, dropped = 0;

std::string shortName(const char *mangled) {
  if (!mangled)
    return "?";
  int status = 0;
  char *plain = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && plain ? plain : mangled;
  std::free(plain);
  // "void ns::kernel<...>(args)" -> "ns::kernel<...>": the arguments say
  // nothing the grid does not, and commas would split the CSV's field.
  if (s.rfind("void ", 0) == 0)
    s = s.substr(5);
  int depth = 0;
  static const std::string anonymous = "(anonymous namespace)";
  for (size_t i = 0; i < s.size(); ++i) {
    if (s.compare(i, anonymous.size(), anonymous) == 0)
      i += anonymous.size() - 1;
    else if (s[i] == '<')
      ++depth;
    else if (s[i] == '>')
      --depth;
    else if (s[i] == '(' && depth == 0) {
      s.resize(i);
      break;
    }
  }
  for (char &c : s)
    if (c == ',' || c == '\n' || c == '"')
      c = ';';
  return s;
}

void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *maxRecords) {
  *buffer = static_cast<uint8_t *>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *maxRecords = 0;
}

void CUPTIAPI completed(CUcontext, uint32_t, uint8_t *buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(mutex);
  CUpti_Activity *record = nullptr;
  while (out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
      auto *k = reinterpret_cast<const CUpti_ActivityKernel10 *>(record);
      std::fprintf(out, "kernel,%u,%u,%llu,%llu,%d,%d,%s\n", k->deviceId, k->streamId, (unsigned long long)k->start,
                   (unsigned long long)k->end, k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ,
                   shortName(k->name).c_str());
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      auto *m = reinterpret_cast<const CUpti_ActivityMemcpy6 *>(record);
      std::fprintf(out, "memcpy,%u,%u,%llu,%llu,%llu,0,kind%u\n", m->deviceId, m->streamId,
                   (unsigned long long)m->start, (unsigned long long)m->end, (unsigned long long)m->bytes,
                   unsigned(m->copyKind));
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      auto *m = reinterpret_cast<const CUpti_ActivityMemset4 *>(record);
      std::fprintf(out, "memset,%u,%u,%llu,%llu,%llu,0,memset\n", m->deviceId, m->streamId,
                   (unsigned long long)m->start, (unsigned long long)m->end, (unsigned long long)m->bytes);
      break;
    }
    default:
      continue;
    }
    ++records;
  }
  size_t lost = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &lost) == CUPTI_SUCCESS)
    dropped += lost;
  std::free(buffer);
}

void check(CUptiResult r, const char *what) {
  if (r == CUPTI_SUCCESS)
    return;
  const char *why = nullptr;
  cuptiGetResultString(r, &why);
  std::fprintf(stderr, "loom-kernel-trace: %s failed: %s\n", what, why ? why : "?");
}

__attribute__((constructor)) void start() {
  const char *path = std::getenv("LOOM_KERNEL_TRACE");
  if (!path || !*path)
    return;
  out = std::fopen(path, "w");
  if (!out) {
    std::fprintf(stderr, "loom-kernel-trace: cannot write %s: %s\n", path, std::strerror(errno));
    return;
  }
  std::fprintf(out, "kind,device,stream,start_ns,end_ns,grid_or_bytes,block,name\n");
  check(cuptiActivityRegisterCallbacks(requested, completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling memcpy records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enabling memset records");
}

__attribute__((destructor)) void finish() {
  if (!out)
    return;
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(mutex);
  std::fprintf(stderr, "loom-kernel-trace: %zu records written to %s%s\n", records, std::getenv("LOOM_KERNEL_TRACE"),
               dropped ? " (CUPTI dropped some: a longer run needs more buffers)" : "");
  std::fclose(out);
  out = nullptr;
}

} // namespace

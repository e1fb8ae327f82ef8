//===- Trace.h - Timelines in Chrome's trace-event format ------*- C++ -*-===//
//
// loom-run --trace writes what every rank ran as Chrome's trace-event JSON,
// which Perfetto (ui.perfetto.dev) and chrome://tracing open: one process
// per rank, one thread per track (compute, communication, ...), one complete
// ("X") event per instruction.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_TRACE_H
#define LOOM_RUNTIME_TRACE_H

#include "runtime/src/Backend.h"

#include <map>
#include <string>
#include <vector>

namespace loom::rt {

struct RankTrace {
  int64_t rank = 0;
  std::map<std::string, int64_t> coords; // dp, tp, pp
  std::vector<Backend::TraceEvent> events;
};

/// Writes the ranks' events (times relative to the earliest) to `path`, as
/// a whole: a temporary file renamed into place. Throws Error.
void writeChromeTrace(const std::string &path, const std::vector<RankTrace> &ranks);

} // namespace loom::rt

#endif

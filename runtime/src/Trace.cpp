//===- Trace.cpp - Timelines in Chrome's trace-event format ---------------===//

#include "runtime/src/Trace.h"
#include "loom/rt/Error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unistd.h>

namespace loom::rt {

void writeChromeTrace(const std::string &path, const std::vector<RankTrace> &ranks) {
  using json = nlohmann::json;
  double epoch = INFINITY;
  for (const RankTrace &r : ranks)
    for (const Backend::TraceEvent &e : r.events)
      epoch = std::min(epoch, e.start);
  if (!std::isfinite(epoch))
    epoch = 0;
  // Tracks in a fixed order: compute first, then the rest as they come.
  std::vector<std::string> tracks = {"compute", "communication", "send"};
  auto trackId = [&](const std::string &t) {
    auto it = std::find(tracks.begin(), tracks.end(), t);
    if (it == tracks.end())
      it = tracks.insert(tracks.end(), t);
    return static_cast<int64_t>(it - tracks.begin());
  };
  json events = json::array();
  for (const RankTrace &r : ranks) {
    std::string name = "rank " + std::to_string(r.rank);
    std::string where;
    for (const auto &[axis, v] : r.coords)
      where += (where.empty() ? "" : ", ") + axis + " " + std::to_string(v);
    if (!where.empty())
      name += " (" + where + ")";
    events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", r.rank}, {"args", {{"name", name}}}});
    events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", r.rank},
                      {"args", {{"sort_index", r.rank}}}});
    std::map<int64_t, std::string> used;
    for (const Backend::TraceEvent &e : r.events) {
      int64_t tid = trackId(e.track);
      used[tid] = e.track;
      events.push_back({{"ph", "X"},
                        {"name", e.name},
                        {"cat", e.track},
                        {"pid", r.rank},
                        {"tid", tid},
                        {"ts", (e.start - epoch) * 1e6},
                        {"dur", e.seconds * 1e6},
                        {"args", {{"instruction", e.where}}}});
    }
    for (const auto &[tid, track] : used)
      events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", r.rank}, {"tid", tid},
                        {"args", {{"name", track}}}});
  }
  json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out)
      fail(LOOM_IO_ERROR, path, ": cannot write the trace (", std::strerror(errno), ")");
    out << doc.dump() << "\n";
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      fail(LOOM_IO_ERROR, path, ": cannot write the trace (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    fail(LOOM_IO_ERROR, path, ": cannot write the trace (", std::strerror(err), ")");
  }
}

} // namespace loom::rt

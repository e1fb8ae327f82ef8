//===- PipelineSchedule.cpp - Per-stage task orders and their timing ------===//

#include "compiler/planner/PipelineSchedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <sstream>

namespace loom::planner {

const char *taskLetter(TaskKind kind) {
  switch (kind) {
  case TaskKind::Forward:
    return "F";
  case TaskKind::Backward:
    return "B";
  case TaskKind::Weight:
    return "W";
  }
  return "?";
}

namespace {
/// ZB-H1: the warm-up forwards of 1F1B, then B before F; a stage defers its
/// W tasks while fewer than min(p, m) microbatches hold activations (forward
/// run, W not yet), so later stages, which 1F1B leaves with fewer in flight,
/// fill the bubble before their next B and at the end with deferred W tasks.
std::vector<PipelineTask> zeroBubbleH1Order(int64_t p, int64_t m, int64_t stage) {
  std::vector<PipelineTask> order;
  int64_t limit = std::min(p, m), f = 0, b = 0, w = 0;
  for (; f < std::min(p - stage, m); ++f)
    order.push_back({TaskKind::Forward, f, 0});
  while (b < m) {
    order.push_back({TaskKind::Backward, b++, 0});
    if (f < m) {
      if (f - w >= limit)
        order.push_back({TaskKind::Weight, w++, 0});
      order.push_back({TaskKind::Forward, f++, 0});
    } else {
      order.push_back({TaskKind::Weight, w++, 0});
    }
  }
  while (w < m)
    order.push_back({TaskKind::Weight, w++, 0});
  return order;
}
} // namespace

std::vector<PipelineTask> stageOrder(Schedule s, int64_t p, int64_t m, int64_t v, int64_t stage) {
  std::vector<PipelineTask> order;
  order.reserve(std::max<int64_t>(m, 0) * (s == Schedule::ZeroBubbleH1  ? 3
                                            : s == Schedule::Interleaved ? 2 * std::max<int64_t>(v, 1)
                                                                         : 2));
  if (s == Schedule::GPipe) {
    for (int64_t mb = 0; mb < m; ++mb)
      order.push_back({TaskKind::Forward, mb, 0});
    for (int64_t mb = 0; mb < m; ++mb)
      order.push_back({TaskKind::Backward, mb, 0});
    return order;
  }
  if (s == Schedule::ZeroBubbleH1)
    return zeroBubbleH1Order(p, m, stage);
  if (s == Schedule::OneFOneB)
    v = 1;
  // Interleaved (and, with v = 1, plain) 1F1B: microbatches go through the
  // chunks in groups of p; warm-up forwards, then one forward one backward.
  int64_t total = m * v;
  auto forwardTask = [&](int64_t k) {
    int64_t group = v == 1 ? 0 : (k / p) % v;
    int64_t mb = v == 1 ? k : (k / (p * v)) * p + k % p;
    return PipelineTask{TaskKind::Forward, mb, group};
  };
  auto backwardTask = [&](int64_t k) {
    PipelineTask t = forwardTask(k);
    t.kind = TaskKind::Backward;
    t.chunk = v - 1 - t.chunk;
    return t;
  };
  int64_t warmup = v == 1 ? std::min(p - stage - 1, m)
                          : std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f)
    order.push_back(forwardTask(f));
  while (f < total) {
    order.push_back(forwardTask(f++));
    order.push_back(backwardTask(b++));
  }
  while (b < total)
    order.push_back(backwardTask(b++));
  return order;
}

std::vector<std::vector<PipelineTask>> stageOrders(Schedule s, int64_t p, int64_t m, int64_t v) {
  std::vector<std::vector<PipelineTask>> orders;
  for (int64_t st = 0; st < p; ++st)
    orders.push_back(stageOrder(s, p, m, s == Schedule::Interleaved ? v : 1, st));
  return orders;
}

double PipelineTimeline::idleFraction() const {
  if (makespan <= 0 || stages.empty())
    return 0;
  double busy = 0;
  for (const auto &tasks : stages)
    for (const TimedTask &t : tasks)
      busy += t.end - t.start;
  return 1 - busy / (makespan * stages.size());
}

PipelineTimeline simulatePipeline(Schedule s, int64_t p, int64_t m, int64_t v,
                                  const ChunkDurations &durations, double transfer,
                                  bool keepTasks,
                                  const std::vector<std::vector<PipelineTask>> *givenOrders) {
  if (s != Schedule::Interleaved)
    v = 1;
  PipelineTimeline tl;
  if (p < 1 || m < 0 || v < 1)
    return tl;
  tl.stages.resize(p);
  auto complete = [&](const std::vector<std::vector<double>> &d) {
    if (static_cast<int64_t>(d.size()) < p)
      return false;
    for (int64_t st = 0; st < p; ++st)
      if (static_cast<int64_t>(d[st].size()) < v)
        return false;
    return true;
  };
  bool zeroBubble = s == Schedule::ZeroBubbleH1;
  bool halfWeight = durations.weightGrad.empty();
  if (!complete(durations.forward) || !complete(durations.backward) ||
      (zeroBubble && !halfWeight && !complete(durations.weightGrad))) {
    tl.deadlocked = true;
    tl.deadlock = "durations must be given for " + std::to_string(p) + " stages of " +
                  std::to_string(v) + " chunk(s) each";
    return tl;
  }
  std::vector<std::vector<PipelineTask>> ownOrders;
  if (!givenOrders || static_cast<int64_t>(givenOrders->size()) != p)
    ownOrders = stageOrders(s, p, m, v);
  const std::vector<std::vector<PipelineTask>> &orders = ownOrders.empty() ? *givenOrders : ownOrders;
  size_t remaining = 0;
  for (int64_t st = 0; st < p; ++st) {
    // Interleaved orders with m not a multiple of p name microbatches past m.
    for (const PipelineTask &t : orders[st])
      if (t.microbatch < 0 || t.microbatch >= m || t.chunk < 0 || t.chunk >= v) {
        tl.deadlocked = true;
        tl.deadlock = std::string("stage ") + std::to_string(st) + " has no task order for " +
                      std::to_string(m) + " microbatches (" + scheduleName(s) +
                      (s == Schedule::Interleaved ? " needs a multiple of pp)" : ")");
        return tl;
      }
    remaining += orders[st].size();
    if (keepTasks)
      tl.stages[st].reserve(orders[st].size());
  }
  // Finish time of each task, by (kind, microbatch, chunk, stage); NaN
  // while it has not run.
  auto key = [&](TaskKind kind, int64_t mb, int64_t chunk, int64_t stage) {
    return ((static_cast<size_t>(kind) * m + mb) * v + chunk) * p + stage;
  };
  std::vector<double> done(3 * static_cast<size_t>(m) * v * p,
                           std::numeric_limits<double>::quiet_NaN());
  auto dependency = [&](const PipelineTask &t, int64_t st, double &ready) -> bool {
    ready = 0;
    auto need = [&](TaskKind kind, int64_t chunk, int64_t stage, double extra) {
      double end = done[key(kind, t.microbatch, chunk, stage)];
      if (std::isnan(end))
        return false;
      ready = std::max(ready, end + extra);
      return true;
    };
    if (t.kind == TaskKind::Forward) {
      if (st > 0)
        return need(TaskKind::Forward, t.chunk, st - 1, transfer);
      if (t.chunk > 0)
        return need(TaskKind::Forward, t.chunk - 1, p - 1, transfer);
      return true;
    }
    if (t.kind == TaskKind::Weight)
      return need(TaskKind::Backward, t.chunk, st, 0);
    if (!need(TaskKind::Forward, t.chunk, st, 0))
      return false;
    if (st < p - 1)
      return need(TaskKind::Backward, t.chunk, st + 1, transfer);
    if (t.chunk < v - 1)
      return need(TaskKind::Backward, t.chunk + 1, 0, transfer);
    return true;
  };
  // A task starts at the later of its stage's last end and its inputs'
  // arrival, whatever order stages are stepped in: each stage runs as far as
  // it can, and one that waits is stepped again when the neighbour it waits
  // on (the previous stage for a forward, the next for a backward) ends a
  // task of that kind.
  std::vector<size_t> next(p, 0);
  std::vector<double> free(p, 0);
  std::vector<char> queued(p, 1);
  std::vector<int64_t> ready;
  for (int64_t st = p - 1; st >= 0; --st)
    ready.push_back(st);
  while (!ready.empty()) {
    int64_t st = ready.back();
    ready.pop_back();
    queued[st] = 0;
    while (next[st] < orders[st].size()) {
      const PipelineTask &t = orders[st][next[st]];
      double arrival;
      if (!dependency(t, st, arrival))
        break;
      double weight = !zeroBubble ? 0
                      : halfWeight ? durations.backward[st][t.chunk] / 2
                                   : durations.weightGrad[st][t.chunk];
      double duration = t.kind == TaskKind::Forward  ? durations.forward[st][t.chunk]
                        : t.kind == TaskKind::Weight ? weight
                                                     : durations.backward[st][t.chunk] - weight;
      double start = std::max(arrival, free[st]), end = start + duration;
      if (keepTasks)
        tl.stages[st].push_back({t, start, end});
      done[key(t.kind, t.microbatch, t.chunk, st)] = end;
      free[st] = end;
      tl.makespan = std::max(tl.makespan, end);
      ++next[st];
      --remaining;
      if (t.kind != TaskKind::Weight) {
        int64_t waiter = t.kind == TaskKind::Forward ? (st + 1) % p : (st + p - 1) % p;
        if (!queued[waiter]) {
          queued[waiter] = 1;
          ready.push_back(waiter);
        }
      }
    }
  }
  if (remaining > 0) {
    tl.deadlocked = true;
    std::ostringstream os;
    for (int64_t st = 0; st < p; ++st)
      if (next[st] < orders[st].size()) {
        const PipelineTask &t = orders[st][next[st]];
        os << "stage " << st << " waits to run " << taskLetter(t.kind) << t.microbatch << "."
           << t.chunk << "; ";
      }
    tl.deadlock = os.str();
  }
  return tl;
}

PipelineTimeline simulatePipeline(Schedule s, int64_t p, int64_t m, int64_t v,
                                  const std::vector<double> &forward,
                                  const std::vector<double> &backward, double transfer,
                                  const std::vector<double> &weightGrad) {
  int64_t chunks = s == Schedule::Interleaved ? std::max<int64_t>(v, 1) : 1;
  ChunkDurations d;
  auto split = [&](const std::vector<double> &perStage, std::vector<std::vector<double>> &out) {
    for (double x : perStage)
      out.emplace_back(chunks, x / double(chunks));
  };
  split(forward, d.forward);
  split(backward, d.backward);
  split(weightGrad, d.weightGrad);
  return simulatePipeline(s, p, m, v, d, transfer);
}

namespace {
std::string escape(const std::string &text) {
  std::string out;
  for (char c : text) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else
      out += c;
  }
  return out;
}
} // namespace

std::string timelineSvg(const PipelineTimeline &tl, const SvgExtras &x) {
  const double left = 90, rowH = 34, gap = 8, top = 60, chartW = 900, memW = 160;
  int64_t p = static_cast<int64_t>(tl.stages.size());
  double total = tl.makespan + x.dpCommSeconds + x.optimizerSeconds;
  if (total <= 0)
    total = 1;
  double scale = chartW / total;
  double height = top + p * (rowH + gap) + 70;
  double width = left + chartW + 40 + memW + 70;
  bool weightTasks = false;
  for (const auto &tasks : tl.stages)
    for (const TimedTask &t : tasks)
      weightTasks |= t.task.kind == TaskKind::Weight;
  std::ostringstream os;
  os.precision(2);
  os << std::fixed;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  os << "<text x=\"" << left << "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">"
     << escape(x.title) << "</text>\n";
  os << "<text x=\"" << left << "\" y=\"44\" fill=\"#555\">step " << total * 1e3
     << " ms; idle (bubble) " << tl.idleFraction() * 100
     << "% of pipeline time; F = forward, B = backward"
     << (weightTasks ? " (input gradient), W = weight gradient" : "")
     << ", number = microbatch</text>\n";
  for (int64_t st = 0; st < p; ++st) {
    double y = top + st * (rowH + gap);
    os << "<text x=\"10\" y=\"" << y + rowH * 0.65 << "\">device " << st << "</text>\n";
    os << "<rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << tl.makespan * scale
       << "\" height=\"" << rowH << "\" fill=\"#eeeeee\"/>\n"; // idle background
    for (const TimedTask &t : tl.stages[st]) {
      double bx = left + t.start * scale, bw = std::max(0.5, (t.end - t.start) * scale);
      int shade = static_cast<int>(t.task.chunk % 4);
      const char *fwd[] = {"#4e79a7", "#6b93c4", "#2f5d8a", "#8fb0d9"};
      const char *bwd[] = {"#59a14f", "#7bbf6f", "#3d7a35", "#9fd393"};
      const char *wgt[] = {"#b07aa1", "#c79bbd", "#8c5a80", "#dcbcd4"};
      const char *fill = t.task.kind == TaskKind::Forward  ? fwd[shade]
                         : t.task.kind == TaskKind::Weight ? wgt[shade]
                                                           : bwd[shade];
      const char *what = t.task.kind == TaskKind::Forward  ? "forward"
                         : t.task.kind == TaskKind::Weight ? "weight gradient"
                                                           : "backward";
      os << "<rect x=\"" << bx << "\" y=\"" << y << "\" width=\"" << bw << "\" height=\"" << rowH
         << "\" fill=\"" << fill << "\" stroke=\"white\" stroke-width=\"0.5\"><title>" << what
         << " microbatch " << t.task.microbatch << ", chunk " << t.task.chunk << ": "
         << t.start * 1e3 << "-" << t.end * 1e3 << " ms</title></rect>\n";
      if (bw > 22)
        os << "<text x=\"" << bx + bw / 2 << "\" y=\"" << y + rowH * 0.65
           << "\" fill=\"white\" text-anchor=\"middle\" font-size=\"10\">"
           << taskLetter(t.task.kind) << t.task.microbatch << "</text>\n";
    }
    double cx = left + tl.makespan * scale;
    if (x.dpCommSeconds > 0)
      os << "<rect x=\"" << cx << "\" y=\"" << y << "\" width=\"" << x.dpCommSeconds * scale
         << "\" height=\"" << rowH << "\" fill=\"#f28e2b\"><title>gradient all-reduce "
         << x.dpCommSeconds * 1e3 << " ms</title></rect>\n";
    cx += x.dpCommSeconds * scale;
    if (x.optimizerSeconds > 0)
      os << "<rect x=\"" << cx << "\" y=\"" << y << "\" width=\""
         << std::max(0.5, x.optimizerSeconds * scale) << "\" height=\"" << rowH
         << "\" fill=\"#9c755f\"><title>optimizer step " << x.optimizerSeconds * 1e3
         << " ms</title></rect>\n";
    // Memory bar.
    if (x.deviceMemoryBytes > 0 && st < static_cast<int64_t>(x.weightBytes.size())) {
      double mx = left + chartW + 40, mw = memW / x.deviceMemoryBytes;
      double w = x.weightBytes[st] * mw, a = x.activationBytes[st] * mw;
      os << "<rect x=\"" << mx << "\" y=\"" << y + 6 << "\" width=\"" << memW << "\" height=\""
         << rowH - 12 << "\" fill=\"none\" stroke=\"#999\"/>\n";
      os << "<rect x=\"" << mx << "\" y=\"" << y + 6 << "\" width=\"" << std::min(w, double(memW))
         << "\" height=\"" << rowH - 12 << "\" fill=\"#76b7b2\"/>\n";
      os << "<rect x=\"" << mx + std::min(w, double(memW)) << "\" y=\"" << y + 6 << "\" width=\""
         << std::max(0.0, std::min(a, memW - std::min(w, double(memW)))) << "\" height=\""
         << rowH - 12 << "\" fill=\"#edc948\"/>\n";
      os << "<text x=\"" << mx + memW + 4 << "\" y=\"" << y + rowH * 0.65 << "\" font-size=\"10\">"
         << (x.weightBytes[st] + x.activationBytes[st]) / double(1ull << 30) << " GiB</text>\n";
    }
  }
  double ly = top + p * (rowH + gap) + 20;
  os << "<g font-size=\"11\">";
  double lx = left;
  std::vector<std::pair<const char *, const char *>> legend = {{"#4e79a7", "forward"}};
  if (weightTasks)
    legend.insert(legend.end(),
                  {{"#59a14f", "backward: input gradient"}, {"#b07aa1", "weight gradient"}});
  else
    legend.push_back({"#59a14f", "backward"});
  legend.insert(legend.end(), {{"#eeeeee", "idle (bubble)"},
                               {"#f28e2b", "gradient all-reduce"},
                               {"#9c755f", "optimizer"},
                               {"#76b7b2", "memory: weights + optimizer"},
                               {"#edc948", "memory: activations"}});
  for (auto [color, label] : legend) {
    os << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"12\" height=\"12\" fill=\"" << color
       << "\" stroke=\"#999\" stroke-width=\"0.5\"/><text x=\"" << lx + 16 << "\" y=\"" << ly + 10
       << "\">" << label << "</text>";
    lx += 16 + 7.0 * std::string(label).size() + 14;
  }
  os << "</g>\n";
  os << "<text x=\"" << left << "\" y=\"" << ly + 34 << "\" fill=\"#555\">time → (0 to "
     << total * 1e3 << " ms)</text>\n";
  if (x.deviceMemoryBytes > 0)
    os << "<text x=\"" << left + chartW + 40 << "\" y=\"" << top - 8
       << "\" fill=\"#555\">memory of " << x.deviceMemoryBytes / double(1ull << 30)
       << " GiB</text>\n";
  os << "</svg>\n";
  return os.str();
}

} // namespace loom::planner

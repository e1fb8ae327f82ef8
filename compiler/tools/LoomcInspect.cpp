//===- LoomcInspect.cpp - loomc inspect: bundles and plan files ------------===//
//
// What `loomc inspect` shows: a bundle's manifest (ranks, programs, buffers,
// parameter shards), or a plan file's prediction with its pipeline simulated
// per device and drawn as SVG (each chunk's own times where the plan lists
// them).
//
//===----------------------------------------------------------------------===//

#include "compiler/tools/LoomcInspect.h"

#include "compiler/planner/PipelineSchedule.h"
#include "compiler/planner/PlanFile.h"
#include "loom/rt/Bundle.h"
#include "loom/rt/Safetensors.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace loom::tools {
namespace {
int fail(const llvm::Twine &message) {
  llvm::WithColor::error(llvm::errs(), "loomc") << message << "\n";
  return 1;
}
} // namespace

int inspectBundle(const std::string &inspectInput) {
  ::loom::rt::Manifest m;
  try {
    m = ::loom::rt::readManifest(inspectInput);
  } catch (const std::exception &e) {
    return fail(e.what());
  }
  llvm::outs() << inspectInput << ": bundle version " << m.version << ", model " << m.model
               << ", " << m.mode << ", batch " << m.batch << ", " << m.ranks.size() << " rank(s)\n";
  if (!m.plan.empty())
    llvm::outs() << "  plan: dp " << m.plan.value("dp", 1) << " x tp " << m.plan.value("tp", 1)
                 << " x pp " << m.plan.value("pp", 1) << ", vpp " << m.plan.value("vpp", 1) << ", "
                 << m.plan.value("microbatches", 1) << " microbatch(es), schedule "
                 << m.plan.value("schedule", std::string("1f1b")) << ", ZeRO-"
                 << m.plan.value("zero", 0)
                 << (m.plan.contains("sequence_parallel") && m.plan["sequence_parallel"].is_boolean() &&
                             m.plan["sequence_parallel"].get<bool>()
                         ? ", sequence parallel"
                         : "")
                 << "\n";
  // How tensor parallelism splits the parameters (rank 0's view; a block's
  // parameters once, as "layer.*").
  if (!m.ranks.empty()) {
    std::map<std::string, std::string> rows;
    for (const auto &p : m.ranks[0].params) {
      if (p.shard.axis < 0)
        continue;
      std::string name = p.name;
      llvm::SmallVector<llvm::StringRef, 3> parts;
      llvm::StringRef(name).split(parts, '.', 2);
      if (parts.size() == 3 && llvm::all_of(parts[1], [](char c) { return isdigit(static_cast<unsigned char>(c)); }))
        name = (parts[0] + ".*." + parts[2]).str();
      const auto &local = m.ranks[0].buffers[p.buffer].shape;
      std::string row = ::loom::rt::shapeStr(p.shard.fullShape) + " -> " + ::loom::rt::shapeStr(local) +
                        " per rank: dimension " + std::to_string(p.shard.axis) + " split over " +
                        std::to_string(p.shard.parts) + " ranks";
      if (p.shard.blocks > 1)
        row += " in each of its " + std::to_string(p.shard.blocks) + " blocks";
      rows[name] = row;
    }
    if (!rows.empty()) {
      llvm::outs() << "  tensor-parallel parameters (the rest are replicated):\n";
      for (const auto &[name, row] : rows)
        llvm::outs() << "    " << llvm::left_justify(name, 22) << " " << row << "\n";
    }
    int64_t zeroParts = 0, chunked = 0;
    for (const auto &p : m.ranks[0].params)
      if (p.shard.zeroParts > 1)
        zeroParts = p.shard.zeroParts, ++chunked;
    if (chunked)
      llvm::outs() << "  ZeRO-3: " << chunked << " of " << m.ranks[0].params.size()
                   << " parameters held as chunks of 1/" << zeroParts
                   << " of their flattened whole (or tensor-parallel part) per rank, gathered for "
                      "the forward and the backward\n";
  }
  for (const auto &r : m.ranks) {
    int64_t params = 0;
    for (const auto &p : r.params)
      params += r.buffers[p.buffer].bytes;
    std::string coords;
    for (const auto &[axis, i] : r.coords)
      coords += (coords.empty() ? ", " : " ") + axis + " " + std::to_string(i);
    llvm::outs() << "  rank " << r.rank << " (" << r.device << coords << "): arena "
                 << llvm::format("%.1f", r.arenaBytes / 1048576.0) << " MiB, parameters "
                 << llvm::format("%.1f", params / 1048576.0) << " MiB in " << r.params.size()
                 << " tensors, activations peak "
                 << llvm::format("%.1f", r.peakActivationBytes / 1048576.0) << " MiB\n";
    for (const auto &in : r.inputs)
      llvm::outs() << "    input  " << in.name << ": "
                   << ::loom::rt::dtypeName(r.buffers[in.buffer].dtype)
                   << ::loom::rt::shapeStr(r.buffers[in.buffer].shape) << "\n";
    for (const auto &out : r.outputs)
      llvm::outs() << "    output " << out.name << ": "
                   << ::loom::rt::dtypeName(r.buffers[out.buffer].dtype)
                   << ::loom::rt::shapeStr(r.buffers[out.buffer].shape) << "\n";
    for (const auto &[name, instrs] : r.programs) {
      std::map<std::string, int> ops;
      for (const auto &ins : instrs)
        ops[ins.op]++;
      llvm::outs() << "    program " << name << ": " << instrs.size() << " instructions (";
      bool first = true;
      for (const auto &[op, n] : ops) {
        llvm::outs() << (first ? "" : ", ") << op << " " << n;
        first = false;
      }
      llvm::outs() << ")\n";
      // Communication by kind, group and layer ("layer.3" from buffer names).
      std::map<std::string, std::map<std::string, int>> comms;
      for (const auto &ins : instrs) {
        std::string kind = ins.op;
        if (kind == "all_reduce" || kind == "broadcast_from" || kind == "reduce_scatter" ||
            kind == "all_gather")
          kind += " " + ins.attrs.value("group", std::string("dp"));
        else if (kind == "send" || kind == "recv")
          kind += " rank " + std::to_string(ins.attrs.value("peer", int64_t(-1)));
        else
          continue;
        int64_t id = ins.out.empty() ? ins.in.front() : ins.out.front();
        llvm::StringRef name = r.buffers[id].name;
        llvm::SmallVector<llvm::StringRef, 3> parts;
        name.split(parts, '.', 2);
        std::string layer = "other";
        if (parts.size() == 3 && !parts[1].empty() &&
            llvm::all_of(parts[1], [](char c) { return isdigit(static_cast<unsigned char>(c)); }))
          layer = (parts[0] + "." + parts[1]).str();
        comms[kind][layer]++;
      }
      for (const auto &[kind, layers] : comms) {
        llvm::outs() << "      " << kind << ":";
        for (const auto &[layer, n] : layers)
          llvm::outs() << " " << layer << " " << n;
        llvm::outs() << "\n";
      }
    }
  }
  return 0;
}

int inspectPlan(const std::string &inspectInput, const std::string &inspectSvg) {
  std::ifstream in(inspectInput);
  nlohmann::json plan = nlohmann::json::parse(in, nullptr, false);
  if (plan.is_discarded() || !::loom::planner::isPlanDocument(plan))
    return fail("'" + inspectInput + "' is neither a bundle directory nor a plan written by "
                "loomc plan --json");
  try {
    using namespace ::loom::planner;
    Schedule schedule;
    if (!parseSchedule(plan.at("schedule").get<std::string>(), schedule))
      return fail(inspectInput + ": unknown schedule");
    int64_t p = plan.at("pp"), m = plan.at("microbatches"), v = plan.at("vpp");
    const auto &pred = plan.at("predicted");
    llvm::outs() << inspectInput << ": " << plan.at("model").get<std::string>() << " on "
                 << plan.at("cluster").get<std::string>() << ", batch " << plan.at("batch").get<int64_t>()
                 << "\n  dp " << plan.at("dp").get<int64_t>() << " x tp " << plan.at("tp").get<int64_t>()
                 << " x pp " << p << (schedule == Schedule::Interleaved ? " x vpp " + std::to_string(v) : "")
                 << ", " << scheduleName(schedule) << ", " << m << " microbatches of "
                 << plan.at("microbatch_size").get<int64_t>() << ", recompute "
                 << plan.at("recompute").get<std::string>() << ", ZeRO-" << plan.at("zero").get<int>()
                 << "\n  predicted step " << llvm::format("%.2f", pred.at("step_ms").get<double>())
                 << " ms, " << llvm::format("%.0f", pred.at("tokens_per_s").get<double>())
                 << " tokens/s, MFU " << llvm::format("%.1f", 100 * pred.at("mfu").get<double>())
                 << "%, peak memory " << llvm::format("%.1f", pred.at("peak_memory_gib").get<double>())
                 << " GiB\n";
    std::vector<double> fwd, bwd, wgt;
    // Each chunk's own times where the plan lists them (loomc plan writes
    // them since the planner simulates interleaved plans chunk by chunk).
    ChunkDurations chunks;
    bool perChunk = true;
    int64_t chunkCount = schedule == Schedule::Interleaved ? v : 1;
    auto chunkTimes = [&](const nlohmann::json &st, const char *field) {
      std::vector<double> out;
      if (!st.contains(field) || !st[field].is_array() ||
          static_cast<int64_t>(st[field].size()) != chunkCount) {
        perChunk = false;
        return out;
      }
      for (const auto &x : st[field])
        out.push_back(x.get<double>() / 1e3);
      return out;
    };
    SvgExtras extras;
    for (const auto &st : plan.at("stages")) {
      fwd.push_back(st.at("forward_ms").get<double>() / 1e3);
      bwd.push_back(st.at("backward_ms").get<double>() / 1e3);
      // Plans written before ZB-H1 have no weight-gradient split: half the backward.
      wgt.push_back(st.value("weight_grad_ms", bwd.back() * 1e3 / 2) / 1e3);
      chunks.forward.push_back(chunkTimes(st, "chunk_forward_ms"));
      chunks.backward.push_back(chunkTimes(st, "chunk_backward_ms"));
      chunks.weightGrad.push_back(chunkTimes(st, "chunk_weight_grad_ms"));
      extras.weightBytes.push_back(st.at("weight_gib").get<double>() * double(1ull << 30));
      extras.activationBytes.push_back(st.at("activation_gib").get<double>() * double(1ull << 30));
    }
    if (static_cast<int64_t>(fwd.size()) != p)
      return fail(inspectInput + ": 'stages' lists " + std::to_string(fwd.size()) +
                  " stages but pp is " + std::to_string(p));
    // One transfer across a boundary; older plans only give their total.
    double transfer = pred.contains("pp_transfer_ms") ? pred.at("pp_transfer_ms").get<double>() / 1e3
                      : m > 0 && p > 1 ? pred.at("pp_comm_ms").get<double>() / 1e3 / m / (2 * v)
                                       : 0;
    PipelineTimeline tl = perChunk ? simulatePipeline(schedule, p, m, v, chunks, transfer)
                                   : simulatePipeline(schedule, p, m, v, fwd, bwd, transfer, wgt);
    if (tl.deadlocked)
      return fail("the schedule deadlocks: " + tl.deadlock);
    llvm::outs() << "  simulated pipeline " << llvm::format("%.2f", tl.makespan * 1e3)
                 << " ms, idle " << llvm::format("%.1f", tl.idleFraction() * 100) << "%\n";
    if (!inspectSvg.empty()) {
      extras.title = plan.at("model").get<std::string>() + ": dp" + std::to_string(plan.at("dp").get<int64_t>()) +
                     " tp" + std::to_string(plan.at("tp").get<int64_t>()) + " pp" + std::to_string(p) +
                     ", " + scheduleName(schedule) + ", " + std::to_string(m) + " microbatches on " +
                     plan.at("cluster").get<std::string>();
      extras.dpCommSeconds = pred.at("dp_comm_ms").get<double>() / 1e3;
      extras.optimizerSeconds = pred.at("optimizer_ms").get<double>() / 1e3;
      extras.deviceMemoryBytes = plan.value("device_memory_gib", 80.0) * double(1ull << 30);
      std::string svg = timelineSvg(tl, extras);
      ::loom::rt::writeFileAtomically(inspectSvg, svg.data(), svg.size());
      llvm::outs() << "wrote " << inspectSvg << "\n";
    }
  } catch (const std::exception &e) {
    return fail(inspectInput + ": malformed plan (" + e.what() + ")");
  }
  return 0;
}

} // namespace loom::tools

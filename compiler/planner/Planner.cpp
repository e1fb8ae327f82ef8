//===- Planner.cpp - Price plans and search for the fastest -------------===//

#include "compiler/planner/Planner.h"
#include "compiler/planner/MemoryModel.h"
#include "compiler/planner/PipelineSchedule.h"
#include "compiler/planner/PlanText.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

namespace loom::planner {

namespace {
std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) {
      out.push_back(d);
      if (d * d != n)
        out.push_back(n / d);
    }
  std::sort(out.begin(), out.end());
  return out;
}

/// Costs of one layer for one microbatch, given tp, microbatch size and recomputation.
struct LayerTimes {
  double forward = 0, backward = 0, recompute = 0, tpComm = 0;
  double weightGrad = 0; // the part of backward that computes weight gradients
  double compute = 0; // the compute part of forward + backward + recompute
  double total() const { return forward + backward + recompute + tpComm; }
};
} // namespace

Planner::Planner(ModelSpec model, Cluster cluster, CostOptions opts)
    : spec(std::move(model)), machines(std::move(cluster)), options(std::move(opts)) {
  calibrateToMeasuredStep();
}

void Planner::calibrateToMeasuredStep() {
  CostOptions &o = options;
  // The profiled model: the one planned, or the profile's own (its memory
  // efficiency is the runtime's kernels on this device, which carry over).
  const ModelSpec *profiled = o.profileModel == spec.name ? &spec
                              : o.profileSpec && o.profileSpec->name == o.profileModel ? o.profileSpec.get()
                                                                                       : nullptr;
  if (o.profileStepSeconds <= 0 || !profiled || o.profileRanks != 1 || o.profileBatch <= 0) {
    if (o.profileStepSeconds > 0 && !profiled)
      o.calibration = "memory efficiency left at " + std::to_string(o.memoryEfficiency) + ": the profile measured " +
                      o.profileModel + ", not " + spec.name + " (pass that model with --profile-model)";
    return;
  }
  // The profiled configuration: one device, one microbatch of the whole batch.
  Plan one;
  one.microbatchSize = o.profileBatch;
  Cluster single = machines; // the profile ran on one device of this kind
  single.devicesPerNode = 1, single.nodes = 1;
  auto stepWith = [&](double efficiency) {
    CostOptions c = o;
    c.profileStepSeconds = 0; // no recursion
    c.memoryEfficiency = efficiency;
    return Planner(*profiled, single, c).evaluate(o.profileBatch, one).stepTime;
  };
  // The step is matrix work C plus memory-bound work M / efficiency.
  double t1 = stepWith(1.0), t2 = stepWith(0.5);
  double memory = t2 - t1, matrix = t1 - memory;
  std::ostringstream note;
  note.precision(3);
  if (memory <= 0 || o.profileStepSeconds <= matrix) {
    note << "the measured step of " << o.profileModel << " (" << o.profileStepSeconds * 1e3
         << " ms) leaves no time for memory-bound work beyond the matrix products' " << matrix * 1e3
         << " ms; memory efficiency left at " << o.memoryEfficiency;
    o.calibration = note.str();
    return;
  }
  // Above 1 where the compiler removes passes the model's byte count includes
  // (epilogues, packed attention operands, fused chains).
  double efficiency = std::clamp(memory / (o.profileStepSeconds - matrix), 0.02, 4.0);
  note << "memory efficiency " << efficiency << " (was " << o.memoryEfficiency << ") from the measured "
       << o.profileStepSeconds * 1e3 << " ms step of " << o.profileModel << " at batch " << o.profileBatch
       << " on one device";
  if (profiled != &spec)
    note << " (the model the profile measured)";
  o.memoryEfficiency = efficiency;
  o.calibration = note.str();
}

int64_t communicatorsPerRank(int64_t dp, int64_t tp, int64_t pp, int64_t vpp, bool zero1, bool sharedAcrossStages,
                             int64_t stage) {
  // A group is known by the plan axes along which its members differ (of
  // more than one rank): groups with the same axes have the same members.
  std::set<std::string> groups;
  auto name = [&](bool d, bool t, bool p) {
    std::string axes = std::string(d && dp > 1 ? "d" : "") + (t && tp > 1 ? "t" : "") + (p && pp > 1 ? "p" : "");
    if (!axes.empty())
      groups.insert(axes);
  };
  name(true, false, false); // the gradients' all-reduce or ZeRO-1's collectives
  name(false, true, false); // tensor-parallel activations
  name(false, false, true); // the loss, broadcast from the last stage
  if (zero1)
    name(true, true, true); // the clipping norm over every slice
  else
    name(false, true, true); // ... over the model-parallel ranks
  // A tensor shared by the first and last stages is summed over those two
  // (the whole pipeline when there are only two).
  if (sharedAcrossStages && pp > 1 && (stage == 0 || stage == pp - 1))
    groups.insert(pp == 2 ? "p" : "first-last");
  // Sends and receives: a communicator per direction to each neighbour;
  // interleaving also joins the last stage to the first.
  std::set<int64_t> neighbours;
  if (pp > 1) {
    if (stage > 0 || vpp > 1)
      neighbours.insert((stage + pp - 1) % pp);
    if (stage < pp - 1 || vpp > 1)
      neighbours.insert((stage + 1) % pp);
  }
  return int64_t(groups.size() + 2 * neighbours.size());
}

Plan Planner::evaluate(int64_t batch, Plan plan) const {
  auto reject = [&](const std::string &why) {
    plan.feasible = false;
    plan.reason = why;
    return plan;
  };
  const DeviceSpec &dev = machines.device;
  int64_t n = machines.numDevices();
  int64_t t = plan.tp, p = plan.pp, d = plan.dp, b = plan.microbatchSize;
  int64_t v = plan.schedule == Schedule::Interleaved ? plan.vpp : 1;
  if (t < 1 || p < 1 || d < 1 || b < 1 || v < 1)
    return reject("degrees and microbatch size must be positive");
  if (d * t * p != n)
    return reject("dp x tp x pp = " + std::to_string(d * t * p) + " but the cluster has " +
                  std::to_string(n) + " devices");
  if (t > machines.devicesPerNode && !options.tpAcrossNodes)
    return reject("tp=" + std::to_string(t) + " spans nodes of " +
                  std::to_string(machines.devicesPerNode) + " devices");
  if (batch % d != 0)
    return reject("batch " + std::to_string(batch) + " is not divisible by dp=" + std::to_string(d));
  if ((batch / d) % b != 0)
    return reject("per-replica batch " + std::to_string(batch / d) +
                  " is not divisible by microbatch size " + std::to_string(b));
  int64_t m = batch / d / b;
  plan.microbatches = m;
  int64_t numLayers = static_cast<int64_t>(spec.layers.size());
  if (p * v > numLayers)
    return reject("pp x vpp = " + std::to_string(p * v) + " exceeds the model's " +
                  std::to_string(numLayers) + " layers");
  if (plan.schedule == Schedule::Interleaved && (v < 2 || m % p != 0))
    return reject("interleaved 1F1B needs vpp >= 2 and microbatches divisible by pp");
  if (plan.zero >= 1 && d == 1)
    return reject(std::string(plan.zero == 3   ? "ZeRO-3 partitions optimizer state, gradients and parameters"
                              : plan.zero == 2 ? "ZeRO-2 partitions optimizer state and gradients"
                                               : "ZeRO-1 partitions optimizer state") +
                  " over data-parallel ranks: it needs dp >= 2");
  if (plan.zero >= 2 && m > 1)
    return reject("ZeRO-" + std::to_string(plan.zero) + " frees each gradient once it is reduce-scattered, but " +
                  std::to_string(m) + " microbatches sum them through the step: use zero=1");
  if (plan.zero == 3 && p > 1)
    return reject("ZeRO-3 gathers each weight for the forward and again for the backward of one stage; "
                  "with pp=" + std::to_string(p) + " use zero=1 or zero=2");
  if (plan.sequenceParallel && t == 1)
    return reject("sequence parallelism splits the tokens over tensor-parallel ranks; it needs tp > 1");
  if (plan.sequenceParallel && b % t != 0)
    return reject("sequence parallelism splits each microbatch's sequences over tp=" + std::to_string(t) +
                  ", which must divide the microbatch size " + std::to_string(b));

  Link intra{dev.intraNodeBandwidth * options.linkEfficiency, dev.intraNodeLatency};
  Link inter{dev.interNodeBandwidth * options.linkEfficiency, dev.interNodeLatency};
  const Link &tpLink = t <= machines.devicesPerNode ? intra : inter;
  // A tensor-parallel collective of `bytes`: its own efficiency, less for
  // small messages (CostOptions::tpLinkEfficiency, linkHalfBytes).
  auto tpLinkFor = [&](double bytes) {
    Link l = tpLink;
    if (options.tpLinkEfficiency > 0)
      l.bandwidth *= options.tpLinkEfficiency / options.linkEfficiency;
    if (options.linkHalfBytes > 0 && bytes > 0)
      l.bandwidth *= bytes / (bytes + options.linkHalfBytes);
    return l;
  };
  const Link &dpLink = t * d <= machines.devicesPerNode ? intra : inter;
  const Link &ppLink = t * d * p <= machines.devicesPerNode ? intra : inter;
  double flopRate = machines.peakFlops(options.matmulDtype) * options.matmulEfficiency;
  double width = options.activationBytes / 2.0; // activations are counted at 16 bits
  double memRate = dev.memoryBandwidth * options.memoryEfficiency;

  // Per-layer costs for one microbatch.
  std::vector<LayerTimes> times(numLayers);
  std::vector<double> layerParams(numLayers);
  std::vector<LayerMemory> memory(numLayers);
  double keptWidth = activationWidth(options.precision);
  for (int64_t i = 0; i < numLayers; ++i) {
    const LayerSpec &l = spec.layers[i];
    int64_t lt = (t > 1 && l.tpDivisor % t == 0) ? t : 1; // no rule: replicate
    double flops = b * (l.shardedFlops / lt + (l.flops - l.shardedFlops));
    // The memory-bound work tensor parallelism splits, and what it leaves
    // whole on every rank unless sequence parallelism splits the tokens
    // (measured on one H200, a tp2 rank of GPT-2 350M at batch 16 alone:
    // 47.8 ms a step, 42.1 with sequence parallelism).
    double replicatedTraffic = lt > 1 && !plan.sequenceParallel ? l.replicatedTraffic : 0;
    double traffic = b * ((l.memoryTraffic - replicatedTraffic) / lt + replicatedTraffic) * width;
    double scores = 0;
    if (options.materializedAttention && l.isTransformer)
      scores = b * 4.0 * 2.0 * l.heads * l.seq * l.seq / lt * width; // write, read, write, read
    LayerTimes &lt_ = times[i];
    // The products' size against the profile's: smaller ones (microbatches,
    // tensor-parallel widths) run slower, larger ones faster.
    double sizeFactor = 1;
    if (options.profileGemmFlops > 0 && l.matmuls > 0 && l.flops > l.attentionFlops) {
      bool split = l.shardedFlops > l.attentionFlops;
      double gemm = b * (l.flops - l.attentionFlops) / l.matmuls / (split ? lt : 1);
      auto saturation = [&](double f) { return f / (f + options.matmulHalfRateFlops); };
      // Never past the dtype's peak.
      sizeFactor = std::min(saturation(gemm) / saturation(options.profileGemmFlops),
                            1.0 / std::max(options.matmulEfficiency, 1e-9));
    }
    double fwdCompute = flops / (flopRate * sizeFactor), fwdMemory = (traffic + scores) / memRate;
    // Launch cost per microbatch pass (tensor parallelism adds its
    // collectives): programs replayed as CUDA graphs, collectives included
    // (LOOM_CUDA_GRAPHS_NCCL, the default since the fifth session of
    // 2026-11-27) and pipelines' sends and receives too (LOOM_CUDA_GRAPHS_P2P,
    // the default since the twenty-second session of 2026-11-29), launch
    // nothing from the host.
    bool graphed = options.graphsOnOneDevice;
    double launches = graphed ? 0 : (l.instructions + (lt > 1 ? l.tpAllReduces : 0)) * options.launchSeconds;
    lt_.forward = fwdCompute + fwdMemory + launches;
    lt_.backward = 2 * fwdCompute + 2 * fwdMemory + 1.4 * launches;
    // With several microbatches each backward adds its weight gradients into
    // f32 accumulators: read 4 + write 4 bytes a parameter, plus the 16-bit
    // gradient it adds; or, where the products add them in
    // (accumulateInProducts), the products' weights 6 bytes more each.
    // Weight gradients: one GEMM per weight matmul of the forward (the
    // attention scores and values have no weights), plus that accumulation.
    lt_.weightGrad = l.flops > 0 ? fwdCompute * (1 - l.attentionFlops / l.flops) : 0;
    if (m > 1) {
      double inProducts = options.accumulateInProducts ? l.shardedParams / lt : 0;
      double accumulate = ((l.shardedParams / lt + (l.params - l.shardedParams) - inProducts) * (8 + 2) +
                           inProducts * 6) / memRate;
      lt_.backward += accumulate;
      lt_.weightGrad += accumulate;
    }
    lt_.compute = 3 * fwdCompute;
    if (plan.recompute == Recompute::Full) {
      lt_.recompute = lt_.forward;
      lt_.compute += fwdCompute;
    } else if (plan.recompute == Recompute::Selective) {
      double attn = b * l.attentionFlops / lt / flopRate;
      lt_.recompute = attn + scores / memRate;
      lt_.compute += attn;
    }
    if (lt > 1) {
      int reductions = l.tpAllReduces * (plan.recompute == Recompute::Full ? 3 : 2);
      double bytes = b * l.boundaryBytes * width;
      lt_.tpComm = reductions * allReduceTime(bytes, lt, tpLinkFor(bytes));
    }
    layerParams[i] = l.shardedParams / lt + (l.params - l.shardedParams);
    LayerMemory &mem = memory[i];
    mem.params = layerParams[i];
    mem.backwardReadParams = l.backwardReadShardedParams / lt + (l.backwardReadParams - l.backwardReadShardedParams);
    for (const TiedParam &tie : l.tied)
      mem.tied.push_back({tie.name, tie.sharded ? tie.elements / lt : tie.elements});
    // Sequence parallelism keeps the replicated values split over tp too,
    // except the gathered inputs of the column-parallel products.
    double replicated = l.keptElements - l.keptShardedElements;
    if (plan.sequenceParallel && lt > 1)
      replicated = l.keptGatheredElements + (replicated - l.keptGatheredElements) / lt;
    double kept = b * keptWidth * (l.keptShardedElements / lt + replicated);
    // Attention that writes its scores (Megatron-LM 2021's; not the
    // runtime's flash attention) keeps them unless recomputed: Korthikanti
    // et al.'s 5as^2 bytes at 16 bits (softmax output, dropout mask and output).
    if (options.materializedAttention && l.isTransformer && plan.recompute == Recompute::None)
      kept += b * 5.0 * l.heads * l.seq * l.seq / lt * keptWidth / 2;
    bool inPlace = options.lossGradientInPlace && lt == 1;
    mem.backwardBytes = inPlace ? b * keptWidth * l.largestGradBesideLoss / (l.largestGradBesideLossSharded ? lt : 1)
                                : b * keptWidth * l.largestGradElements / (l.largestGradSharded ? lt : 1);
    mem.deferredBytes = b * keptWidth * (l.deferredShardedElements / lt + (l.deferredElements - l.deferredShardedElements));
    mem.recomputed = plan.recompute == Recompute::Full && l.checkpointElements > 0;
    if (mem.recomputed) { // keeps its input; its backward rebuilds the rest first
      mem.keptBytes = b * keptWidth * l.checkpointElements;
      mem.backwardBytes += kept;
    } else {
      mem.keptBytes = kept;
    }
  }

  // Stages: contiguous chunks (p x v of them, dealt round-robin to stages for
  // interleaving) minimising the slowest stage under the memory cap; found by
  // binary search on the bottleneck time with greedy packing, which is exact
  // for contiguous min-max partitions.
  int64_t chunks = p * v;
  std::vector<double> prefixTime(numLayers + 1, 0);
  for (int64_t i = 0; i < numLayers; ++i)
    prefixTime[i + 1] = prefixTime[i] + times[i].total();
  auto pack = [&](double limit, std::vector<int64_t> &bounds) {
    bounds.assign(1, 0);
    int64_t at = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t left = chunks - c - 1; // every later chunk needs a layer
      int64_t end = at + 1;
      if (end > numLayers - left)
        return false;
      while (end < numLayers - left && prefixTime[end + 1] - prefixTime[at] <= limit)
        ++end;
      if (c == chunks - 1)
        end = numLayers;
      if (prefixTime[end] - prefixTime[at] > limit * (1 + 1e-12))
        return false;
      at = end;
      bounds.push_back(at);
    }
    return at == numLayers;
  };
  double lo = 0, hi = prefixTime[numLayers];
  for (int64_t i = 0; i < numLayers; ++i)
    lo = std::max(lo, times[i].total());
  std::vector<int64_t> bounds;
  if (!pack(hi, bounds))
    return reject("cannot split " + std::to_string(numLayers) + " layers into " +
                  std::to_string(chunks) + " chunks");
  for (int iter = 0; iter < 40 && hi - lo > 1e-9 * hi; ++iter) {
    double mid = 0.5 * (lo + hi);
    std::vector<int64_t> trial;
    if (pack(mid, trial))
      hi = mid;
    else
      lo = mid;
  }
  // The bottleneck is now fixed; spread the rest evenly so that no stage is
  // needlessly idle: each boundary goes as close to its share of the total
  // time as the bottleneck allows (this matters most when interleaving deals
  // chunks round-robin, where a greedy packing would load the first stages).
  {
    double total = prefixTime[numLayers];
    bounds.assign(1, 0);
    int64_t at = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t left = chunks - c - 1;
      if (left == 0) {
        bounds.push_back(numLayers);
        break;
      }
      double target = total * double(c + 1) / double(chunks);
      int64_t best = at + 1;
      for (int64_t end = at + 1; end <= numLayers - left; ++end) {
        if (prefixTime[end] - prefixTime[at] > hi * (1 + 1e-12))
          break;
        if (std::abs(prefixTime[end] - target) < std::abs(prefixTime[best] - target))
          best = end;
      }
      at = best;
      bounds.push_back(at);
    }
    // Falling back to the packing if the balanced split broke the bottleneck.
    double worst = 0;
    for (int64_t c = 0; c < chunks; ++c)
      worst = std::max(worst, prefixTime[bounds[c + 1]] - prefixTime[bounds[c]]);
    if (worst > hi * (1 + 1e-9))
      pack(hi, bounds);
  }

  // Whether a tensor is read in both the first and the last stage (GPT's
  // tied embedding and head): the two sum its gradient over a group of their own.
  bool sharedAcrossStages = false;
  {
    std::map<std::string, std::set<int64_t>> stagesOfTie;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t i = bounds[c]; i < bounds[c + 1]; ++i)
        for (const TiedParam &tie : spec.layers[i].tied)
          stagesOfTie[tie.name].insert(c % p);
    for (const auto &[tie, stages] : stagesOfTie)
      sharedAcrossStages |= stages.size() > 1;
  }
  plan.stages.assign(p, StagePlan());
  std::vector<double> paramsPerStage(p, 0);
  std::vector<std::vector<std::vector<LayerMemory>>> stageChunks(p);
  for (int64_t c = 0; c < chunks; ++c) {
    StagePlan &s = plan.stages[c % p];
    int64_t first = bounds[c], count = bounds[c + 1] - bounds[c];
    if (c < p)
      s.firstLayer = first;
    s.numLayers += count;
    s.chunks.push_back({first, count});
    stageChunks[c % p].emplace_back(memory.begin() + first, memory.begin() + first + count);
    double forward = 0, backward = 0, weightGrad = 0;
    for (int64_t i = first; i < first + count; ++i) {
      forward += times[i].forward + times[i].tpComm / 2;
      backward += times[i].backward + times[i].recompute + times[i].tpComm / 2;
      weightGrad += times[i].weightGrad;
      paramsPerStage[c % p] += layerParams[i];
    }
    if (v > 1) { // only interleaved stages have chunks of their own to time
      s.chunkForwardTimes.push_back(forward);
      s.chunkBackwardTimes.push_back(backward);
      s.chunkWeightGradTimes.push_back(weightGrad);
    }
    s.forwardTime += forward, s.backwardTime += backward, s.weightGradTime += weightGrad;
  }
  ParameterBytes perParam = parameterBytes(options.precision, plan.zero, d, m, options.gradReduceBf16);
  // The peer's bf16 gradients a two-rank group's update sums (peerDeferredSums).
  // Not under tensor or pipeline parallelism: there the global norm sums
  // over the model-parallel group, and the runtime keeps the all-reduce's sums.
  bool deferredSums = options.peerDeferredSums && d == 2 && t == 1 && p == 1 && plan.zero == 0 && m == 1 &&
                      options.precision == Precision::Bf16 && !options.gradReduceBf16 &&
                      d <= machines.devicesPerNode;
  auto deferredSumBytes = [&](int64_t st) {
    if (!deferredSums)
      return 0.0;
    double elements = 0;
    for (const std::vector<LayerMemory> &chunk : stageChunks[size_t(st)])
      for (const LayerMemory &l : chunk) {
        elements += l.params;
        for (const auto &[name, tied] : l.tied)
          elements -= tied;
      }
    return 2 * std::max(0.0, elements);
  };
  double slowest = 0, slowestCompute = 0, slowestTp = 0, slowestForward = 0, slowestWeight = 0;
  for (int64_t st = 0; st < p; ++st) {
    StagePlan &s = plan.stages[st];
    StageSchedule held;
    held.inFlight = microbatchesInFlight(plan.schedule, p, m, v, st);
    held.microbatched = m > 1;
    if (plan.schedule == Schedule::ZeroBubbleH1) {
      // 1F1B's microbatches waiting for their backward, and as many more as
      // its p allow waiting for their weight gradients.
      double waiting = microbatchesInFlight(Schedule::OneFOneB, p, m, v, st);
      held.deferred = held.inFlight - waiting;
      held.inFlight = waiting;
      held.weightTaskApart = true;
    }
    StageMemory mem = stageMemory(stageChunks[st], perParam, held);
    s.weightBytes = mem.persistentBytes;
    s.activationBytes = mem.peakBytes;
    s.memoryBytes = s.weightBytes + s.activationBytes + options.runtimeBytes +
                    options.communicatorBytes *
                        double(communicatorsPerRank(d, t, p, v, plan.zero > 0, sharedAcrossStages, st)) +
                    (t > 1 ? options.tpChannelBytes : 0.0) +
                    (plan.zero > 0 && d > 1 && options.zeroWideSums && options.precision == Precision::Bf16
                         ? options.zeroPointToPointBytes
                         : 0.0) +
                    (d == 2 ? options.peerScratchBytes : 0.0) + deferredSumBytes(st);
    double stageTime = s.forwardTime + s.backwardTime;
    if (stageTime > slowest) {
      slowest = stageTime;
      slowestForward = s.forwardTime, slowestWeight = s.weightGradTime;
      slowestCompute = 0, slowestTp = 0;
      for (int64_t c = st; c < chunks; c += p)
        for (int64_t i = bounds[c]; i < bounds[c + 1]; ++i)
          slowestCompute += times[i].compute, slowestTp += times[i].tpComm;
    }
    plan.peakMemoryBytes = std::max(plan.peakMemoryBytes, s.memoryBytes);
  }

  // Pipeline transfers: each microbatch's activation forward and its gradient
  // back, split over tp (Megatron's scatter/gather), once per chunk boundary.
  double boundary = 0;
  for (const LayerSpec &l : spec.layers)
    boundary = std::max(boundary, l.boundaryBytes);
  double transfer = p > 1 ? p2pTime(b * boundary * width / t, ppLink) : 0;
  double p2p = 2 * v * transfer;
  double ppComm = m * p2p;
  double steady = m * slowest + ppComm;
  double bubble = slowest > 0 ? bubbleFraction(plan.schedule, p, m, v, slowestForward / slowest,
                                                slowestWeight / slowest) *
                                     steady
                              : 0;
  // Interleaved 1F1B: the closed form above assumes v equal chunks a stage
  // and every transfer exposed, but chunks hold whole layers (one or two
  // blocks, the head more than one), and with few microbatches a group of p
  // leaves no slack: each chunk boundary waits for the neighbour's chunk and
  // two transfers. So the pipeline is simulated with each chunk's own times
  // (GPT 1.3B, pp2 x vpp8, 2 microbatches of 8 on two H200s: measured
  // 152.6 ms, 31.5 of them waiting in receives; the closed form said 141.9
  // ms, 14.3 of bubble and transfers), once without transfers for the
  // bubble and once with them for what they add. Plans over the memory cap
  // are rejected below and skip it.
  // 1F1B and ZB-H1 the same way, each stage with its own times: the closed
  // form charges every stage the slowest one's (GPT 1.3B pp4 1F1B, 8
  // microbatches of 4, on four H200s: measured 170.5 ms, the closed form
  // 187.8, the simulation 178.3).
  bool simulated = plan.schedule == Schedule::Interleaved || plan.schedule == Schedule::OneFOneB ||
                   plan.schedule == Schedule::ZeroBubbleH1;
  if (simulated && p > 1 && plan.peakMemoryBytes <= dev.memoryBytes) {
    ChunkDurations durations;
    for (const StagePlan &s : plan.stages) {
      durations.forward.push_back(v > 1 ? s.chunkForwardTimes : std::vector<double>{s.forwardTime});
      durations.backward.push_back(v > 1 ? s.chunkBackwardTimes : std::vector<double>{s.backwardTime});
      durations.weightGrad.push_back(v > 1 ? s.chunkWeightGradTimes : std::vector<double>{s.weightGradTime});
    }
    std::vector<std::vector<PipelineTask>> orders = stageOrders(plan.schedule, p, m, v);
    PipelineTimeline idle = simulatePipeline(plan.schedule, p, m, v, durations, 0.0, /*keepTasks=*/false, &orders);
    // Blocking sends hold the sending stage for the transfer, after which
    // the data is there; others leave it free and arrive `transfer` later.
    double latency = transfer;
    if (!options.pipelineSendsOverlap) {
      for (int64_t st = 0; st < p; ++st)
        for (int64_t c = 0; c < v; ++c) {
          if (st < p - 1 || c < v - 1)
            durations.forward[st][c] += transfer;
          if (st > 0 || c > 0)
            durations.backward[st][c] += transfer;
        }
      latency = 0;
    }
    PipelineTimeline timed = simulatePipeline(plan.schedule, p, m, v, durations, latency, /*keepTasks=*/false, &orders);
    if (idle.deadlocked || timed.deadlocked)
      return reject("the interleaved schedule deadlocks: " + idle.deadlock + timed.deadlock);
    bubble = std::max(0.0, idle.makespan - m * slowest);
    ppComm = std::max(0.0, timed.makespan - idle.makespan);
    steady = m * slowest + ppComm;
  }

  // Gradients: fp32 all-reduce over dp (ZeRO-1: reduce-scatter, then all-gather bf16 weights).
  // (The time model counts a tied tensor once per layer that reads it.)
  double stageParams = *std::max_element(paramsPerStage.begin(), paramsPerStage.end()), stageTensors = 0;
  for (const StagePlan &s : plan.stages) {
    double tensors = 0;
    for (auto [first, count] : s.chunks)
      for (int64_t i = first; i < first + count && i < numLayers; ++i)
        tensors += spec.layers[i].paramTensors;
    stageTensors = std::max(stageTensors, tensors);
  }
  double dpComm = 0;
  bool zeroApart = d > 1 && plan.zero && !options.zeroPackedCollectives;
  if (zeroApart) // LOOM_CUDA_ZERO_PACKED=0: exposed, f32 both ways, a call per tensor
    dpComm = reduceScatterTime(4 * stageParams, d, dpLink) + allGatherTime(4 * stageParams, d, dpLink) +
             2 * stageTensors * options.zeroCallSeconds;
  else if (d > 1) {
    // --grad-reduce bf16: the plain all-reduce's bf16 gradients travel as bf16.
    double width = !plan.zero && options.gradReduceBf16 && options.precision == Precision::Bf16 ? 2 : 4;
    // ZeRO's reduce-scatter of bf16 gradients sends them as bf16 and sums
    // in f32 (the runtime's wide sums).
    double scatterWidth = options.zeroWideSums && options.precision == Precision::Bf16 ? 2 : 4;
    dpComm = plan.zero ? reduceScatterTime(scatterWidth * stageParams, d, dpLink)
                       : allReduceTime(width * stageParams, d, dpLink);
    // The runtime's deferred sums (peerDeferredSums): each rank's bf16
    // gradients cross once, whole, and nothing comes back.
    if (deferredSums)
      dpComm = allGatherTime(2.0 * d * stageParams, d, dpLink);
  }
  // ZeRO-1's reduce-scatter goes out in the same buckets, but measured on
  // two H200s nothing of it is hidden: GPT-2 350M's and GPT 1.3B's ZeRO-1
  // steps are 2.6 and 11.7 ms longer than plain dp2's (2026-11-27), what
  // the exposed reduce-scatter, gather and packing below add up to (-2.4%
  // and -0.8%); hiding a fifth of it, as of the all-reduce, made ZeRO-1
  // the faster of the two.
  if (!zeroApart && !plan.zero && options.overlapGradientReduce && options.overlapCollectives) {
    // Buckets go out while the last microbatch's backward runs; the last
    // bucket (about 1/16 of the gradients) is always exposed.
    double window = 0;
    for (const StagePlan &s : plan.stages)
      window = std::max(window, s.backwardTime);
    dpComm = std::max(dpComm / 16, dpComm - std::min(window, dpComm) * options.commHiddenShare);
  }
  // ZeRO over peer memory (two ranks in a node): the reduce-scatters go out
  // in the backward's buckets and the gathers in the forward's, hidden as
  // the all-reduce is, the last of each exposed; nothing is packed.
  bool zeroPeers = !zeroApart && d == 2 && plan.zero && options.peerZero && t * d <= machines.devicesPerNode &&
                   options.overlapGradientReduce && options.overlapCollectives;
  if (zeroPeers) {
    double backward = 0, forward = 0;
    for (const StagePlan &s : plan.stages)
      backward = std::max(backward, s.backwardTime), forward = std::max(forward, s.forwardTime);
    auto hidden = [&](double comm, double window) {
      return std::max(comm / 16, comm - std::min(window, comm) * options.commHiddenShare);
    };
    double width = options.precision == Precision::Bf16 ? 2 : 4;
    double gather = allGatherTime(width * stageParams, d, dpLink);
    dpComm = hidden(dpComm, backward) + hidden(gather, forward);
    if (plan.zero == 3) // the backward's gathers beside its reduce-scatters
      dpComm += hidden(gather, std::max(0.0, backward - dpComm));
  }
  if (!zeroApart && d > 1 && plan.zero && !zeroPeers) {
    // ZeRO-1 as the runtime runs it by default: the weights gathered where
    // the next forward waits for them (bf16 copies; f32 masters in the
    // update for f32 steps), and the buckets packed for each collective and
    // unpacked after it, at plain memory bandwidth.
    double width = options.precision == Precision::Bf16 ? 2 : 4;
    // Packing the reduce-scatter's bf16 parts moves 2 bytes a parameter less than widening them.
    double packBytes = options.zeroPackBytesPerParam - (options.zeroWideSums && width == 2 ? 2 : 0);
    dpComm += allGatherTime(width * stageParams, d, dpLink) +
              packBytes * stageParams / (dev.memoryBandwidth * 0.8);
    // ZeRO-3 gathers every weight again for the backward. Its buckets go
    // out a bucket ahead of their layers, but until two GPUs measure how
    // much of that hides, it is priced as exposed, as ZeRO-1's gather is.
    if (plan.zero == 3)
      dpComm += allGatherTime(width * stageParams, d, dpLink);
  }
  // Sequence parallelism: the replicated parameters' gradients (norms,
  // biases, position embeddings), each rank's from its own tokens, summed
  // over tp in one f32 all-reduce at the start of the update.
  double spSums = 0;
  if (plan.sequenceParallel && t > 1)
    for (const StagePlan &s : plan.stages) {
      double replicated = 0;
      for (auto [first, count] : s.chunks)
        for (int64_t i = first; i < first + count && i < numLayers; ++i)
          replicated += spec.layers[i].params - spec.layers[i].shardedParams;
      double bytes = 4 * replicated / (plan.zero ? d : 1);
      spSums = std::max(spSums, allReduceTime(bytes, t, tpLinkFor(bytes)));
    }
  // Adam reads and writes ~30 bytes per parameter (fp32 master, m, v, grad; bf16 weight).
  double optimizer = 30.0 * stageParams / (plan.zero ? d : 1) / memRate;

  plan.stepTime = steady + bubble + dpComm + spSums + optimizer;
  plan.computeTime = m * (slowest - slowestTp); // dense and memory-bound work
  (void)slowestCompute;
  plan.tpCommTime = m * slowestTp + spSums;
  plan.ppCommTime = ppComm;
  plan.ppTransferTime = transfer;
  plan.dpCommTime = dpComm;
  plan.optimizerTime = optimizer;
  plan.communicationTime = plan.tpCommTime + plan.ppCommTime + plan.dpCommTime;
  plan.bubbleTime = bubble;
  double tokens = double(batch) * spec.tokensPerExample;
  plan.tokensPerSecond = tokens / plan.stepTime;
  double modelFlops = spec.trainingFlopsPerExample * batch;
  plan.tflopsPerDevice = modelFlops / plan.stepTime / n / 1e12;
  plan.mfu = modelFlops / plan.stepTime / n / machines.peakFlops("bf16");
  if (plan.peakMemoryBytes > dev.memoryBytes) {
    int64_t worst = 0;
    for (int64_t st = 0; st < p; ++st)
      if (plan.stages[st].memoryBytes > plan.stages[worst].memoryBytes)
        worst = st;
    return reject("stage " + std::to_string(worst) + " needs " + gib(plan.peakMemoryBytes) +
                  " but a " + dev.name + " has " + gib(dev.memoryBytes) + " (over by " +
                  gib(plan.peakMemoryBytes - dev.memoryBytes) + ")");
  }
  plan.feasible = true;
  return plan;
}

PlanResult Planner::search(int64_t batch, const Constraints &c) const {
  auto start = std::chrono::steady_clock::now();
  PlanResult result;
  int64_t n = machines.numDevices();
  if (n < 1) {
    result.error = "the cluster has no devices";
    return result;
  }
  if (batch < 1) {
    result.error = "the batch must be at least 1, got " + std::to_string(batch);
    return result;
  }
  int64_t mainDivisor = 0;
  for (const LayerSpec &l : spec.layers)
    if (l.isTransformer)
      mainDivisor = std::gcd(mainDivisor, l.tpDivisor);
  std::vector<Plan> feasible, infeasible;
  auto consider = [&](Plan plan) {
    ++result.evaluated;
    Plan done = evaluate(batch, plan);
    bool fits = done.feasible;
    (fits ? feasible : infeasible).push_back(std::move(done));
    return fits;
  };
  for (int64_t t : divisors(n)) {
    if (c.tp && *c.tp != t)
      continue;
    if (!c.tp && ((t > machines.devicesPerNode && !options.tpAcrossNodes) ||
                  (t > 1 && mainDivisor > 0 && mainDivisor % t != 0)))
      continue;
    for (int64_t p : divisors(n / t)) {
      if ((c.pp && *c.pp != p) || p > static_cast<int64_t>(spec.layers.size()))
        continue;
      int64_t d = n / t / p;
      if ((c.dp && *c.dp != d) || batch % d != 0)
        continue;
      for (int64_t b : divisors(batch / d)) {
        // Microbatches above 64 examples only where forced (mbs, or mb naming
        // their count: ResNet-50 at 128 images a GPU with mb=1).
        if ((c.microbatchSize && *c.microbatchSize != b) || (!c.microbatchSize && !c.microbatches && b > 64))
          continue;
        int64_t m = batch / d / b;
        if (c.microbatches && *c.microbatches != m)
          continue;
        std::vector<std::pair<Schedule, int64_t>> schedules;
        if (p == 1) {
          schedules.push_back({Schedule::OneFOneB, 1});
        } else {
          schedules.push_back({Schedule::GPipe, 1});
          schedules.push_back({Schedule::OneFOneB, 1});
          if (options.zeroBubbleSchedule || c.schedule == Schedule::ZeroBubbleH1)
            schedules.push_back({Schedule::ZeroBubbleH1, 1});
          for (int64_t v = 2; v <= 8; ++v)
            if (p * v <= static_cast<int64_t>(spec.layers.size()) && m % p == 0)
              schedules.push_back({Schedule::Interleaved, v});
        }
        for (auto [s, v] : schedules) {
          if (c.schedule && *c.schedule != s)
            continue;
          if (c.vpp && s == Schedule::Interleaved && *c.vpp != v)
            continue;
          for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
            if (c.recompute && *c.recompute != r)
              continue;
            bool zero1Fits = true, zero2Fits = true;
            for (int z : {0, 1, 2, 3}) {
              if ((c.zero && *c.zero != z) || (z >= 1 && d == 1 && !c.zero))
                continue;
              // ZeRO-2 only where ZeRO-1 does not fit, ZeRO-3 only where
              // ZeRO-2 does not (or forced): their waits for each bucket are
              // not yet measured against ZeRO-1's.
              if (z == 2 && !c.zero && (zero1Fits || m > 1))
                continue;
              if (z == 3 && !c.zero && (zero1Fits || zero2Fits || m > 1 || p > 1))
                continue;
              Plan plan;
              plan.dp = d, plan.tp = t, plan.pp = p, plan.vpp = v;
              plan.microbatchSize = b, plan.schedule = s, plan.recompute = r, plan.zero = z;
              // Sequence parallelism only where forced: its speed is not yet
              // measured (no two-GPU machine since it was built).
              plan.sequenceParallel = c.sp.value_or(false);
              bool fits = consider(plan);
              if (z == 1)
                zero1Fits = fits;
              if (z == 2)
                zero2Fits = fits;
            }
          }
        }
      }
    }
  }
  // A fully forced plan that the loops skipped (e.g. tp not dividing the devices).
  if (result.evaluated == 0 && c.tp && c.pp && c.dp) {
    Plan plan;
    plan.dp = *c.dp, plan.tp = *c.tp, plan.pp = *c.pp, plan.vpp = c.vpp.value_or(1);
    plan.microbatchSize = c.microbatchSize.value_or(1);
    plan.schedule = c.schedule.value_or(Schedule::OneFOneB);
    plan.recompute = c.recompute.value_or(Recompute::None);
    plan.zero = c.zero.value_or(0);
    plan.sequenceParallel = c.sp.value_or(false);
    consider(plan);
  }
  // Ties (launch-bound models, where recomputing costs no predicted time)
  // go to less recomputation, which always costs real time, then less memory.
  auto faster = [](const Plan &a, const Plan &b) {
    if (a.stepTime != b.stepTime)
      return a.stepTime < b.stepTime;
    if (a.recompute != b.recompute)
      return a.recompute < b.recompute;
    return a.peakMemoryBytes < b.peakMemoryBytes;
  };
  std::sort(feasible.begin(), feasible.end(), faster);
  std::sort(infeasible.begin(), infeasible.end(), [](const Plan &a, const Plan &b) {
    return a.peakMemoryBytes < b.peakMemoryBytes;
  });
  if (!feasible.empty()) {
    result.found = true;
    result.best = feasible.front();
    // Runners-up of other shapes first: they explain the choice best.
    for (size_t i = 1; i < feasible.size() && result.alternatives.size() < 3; ++i) {
      Plan alt = feasible[i];
      bool sameShape = false;
      for (const Plan &a : result.alternatives)
        sameShape |= a.dp == alt.dp && a.tp == alt.tp && a.pp == alt.pp;
      sameShape |= alt.dp == result.best.dp && alt.tp == result.best.tp && alt.pp == result.best.pp;
      if (sameShape)
        continue;
      double slower = alt.stepTime / result.best.stepTime - 1;
      std::ostringstream why;
      why.precision(1);
      why << std::fixed << slower * 100 << "% slower (step " << ms(alt.stepTime) << ")";
      alt.reason = why.str();
      result.alternatives.push_back(alt);
    }
    for (size_t i = 0; i < infeasible.size() && i < 2; ++i)
      if (infeasible[i].reason.find("needs") != std::string::npos)
        result.alternatives.push_back(infeasible[i]);
  } else if (!infeasible.empty()) {
    result.error = "no plan fits" +
                   (describeConstraints(c).empty() ? std::string()
                                                   : " with --force " + describeConstraints(c)) +
                   ": the closest, " + infeasible.front().shortName() + ", fails because " +
                   infeasible.front().reason;
  } else {
    result.error = "no plan satisfies --force " + describeConstraints(c) + " on " +
                   machines.describe() + " with batch " + std::to_string(batch) +
                   " (the degrees must multiply to the device count and divide the batch)";
  }
  result.searchSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

} // namespace loom::planner

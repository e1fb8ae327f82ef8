//===- Bf16StepCasts.cpp - Fewer, earlier bf16 casts in a training step ---===//
//
// The loom-bf16-step-casts pass: eight rewrites of mixed-precision training
// steps, applied in this order to every rank.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"


namespace mlir::loom {
#define GEN_PASS_DEF_BF16STEPCASTS
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Mixed precision leaves each parameter's gradient in bf16 and casts it to
/// f32 for the optimizer. Where that f32 copy is read only by the update
/// (the clipping norm and the optimizer: no all-reduce, no accumulation over
/// microbatches), they read the bf16 gradient instead: the widening is exact,
/// so the update is the same, without a cast per parameter per step or the
/// f32 copies' memory.
int64_t optimizerReadsBf16Gradients(rt::RankProgram &r) {
  if (!r.programs.count("backward") || !r.programs.count("update"))
    return 0;
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  // By storage: a view's reads and writes count as its root's.
  auto [readers, writers] = storageUses(r);
  std::set<int64_t> outputs;
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  std::vector<rt::Instruction> &backward = r.programs["backward"];
  std::vector<bool> dropped(backward.size(), false);
  int64_t changed = 0;
  for (rt::Parameter &p : r.params) {
    int64_t g = p.grad;
    if (g < 0 || r.buffers[g].dtype != LOOM_F32 || r.buffers[g].viewOf >= 0 || outputs.count(g) ||
        writers[g].size() != 1 || writers[g][0].program != "backward")
      continue;
    size_t at = writers[g][0].index;
    const rt::Instruction &cast = backward[at];
    if (cast.op != "cast" || cast.in.size() != 1)
      continue;
    int64_t source = cast.in[0], storage = root(source);
    if (r.buffers[source].dtype != LOOM_BF16 || outputs.count(storage) || readers[storage].size() != 1 ||
        writers[storage].size() != 1 || writers[storage][0].program != "backward")
      continue;
    bool onlyUpdate = !readers[g].empty();
    for (auto [name, i] : readers[g]) {
      const std::string &op = r.programs[name][i].op;
      onlyUpdate &= name == "update" && (op == "global_norm" || op == "adamw" || op == "sgd");
    }
    if (!onlyUpdate)
      continue;
    for (auto [name, i] : readers[g])
      for (int64_t &id : r.programs[name][i].in)
        if (id == g)
          id = source;
    dropped[at] = true;
    p.grad = source;
    ++changed;
  }
  eraseMarked(backward, dropped);
  return changed;
}

/// Whether `ins` is a cast of a bf16 buffer to f32.
bool widensBf16(const rt::RankProgram &r, const rt::Instruction &ins) {
  return ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1 && r.buffers[ins.in[0]].dtype == LOOM_BF16 &&
         r.buffers[ins.out[0]].dtype == LOOM_F32;
}

/// How often each buffer is read (by id), and written and read by storage
/// (a view's writes are its root's), over every program; which programs
/// read each storage.
struct Accesses {
  std::map<int64_t, int64_t> reads, writes;
  std::map<int64_t, std::set<std::string>> readIn;
};
Accesses accessesOf(const rt::RankProgram &r) {
  Accesses a;
  for (const auto &[name, list] : r.programs)
    for (const rt::Instruction &ins : list) {
      for (int64_t id : ins.in)
        ++a.reads[id], a.readIn[rt::storageOf(r, id)].insert(name);
      for (int64_t id : ins.out)
        ++a.writes[rt::storageOf(r, id)];
    }
  return a;
}

/// Gradients reach f32 sums through a bf16 -> f32 cast and an add (the tied
/// embedding's two contributions; every weight's gradient added into its
/// accumulator once per microbatch). The add reads the bf16 value itself
/// instead (both backends widen it exactly and add in f32): the same sums
/// without a cast kernel and an f32 copy per gradient.
int64_t addsReadBf16Gradients(rt::RankProgram &r) {
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  auto [reads, writes, readIn] = accessesOf(r);
  std::set<int64_t> kept = keptBuffers(r), viewed = viewedBuffers(r);
  int64_t changed = 0;
  for (auto &[name, list] : r.programs) {
    std::map<int64_t, size_t> castOf; // f32 result -> its cast
    for (size_t i = 0; i < list.size(); ++i)
      if (widensBf16(r, list[i]))
        castOf[list[i].out[0]] = i;
    std::vector<bool> dropped(list.size(), false);
    for (rt::Instruction &ins : list) {
      if (ins.op != "add" || ins.in.size() != 2 || ins.out.size() != 1 ||
          r.buffers[ins.out[0]].dtype != LOOM_F32)
        continue;
      for (int64_t &id : ins.in) {
        auto it = castOf.find(id);
        if (it == castOf.end() || dropped[it->second] || reads[id] != 1 || writes[id] != 1 || kept.count(id) ||
            viewed.count(id) || r.buffers[id].viewOf >= 0 || r.buffers[id].shape != r.buffers[ins.out[0]].shape)
          continue;
        int64_t source = list[it->second].in[0];
        if (writes[root(source)] != 1)
          continue;
        id = source;
        dropped[it->second] = true;
        ++changed;
      }
    }
    eraseMarked(list, dropped);
  }
  return changed;
}

/// What the two rewrites after it share: in each program, every operand `id`
/// of a bucket collective (`isBucket`) that a cast from bf16 wrote earlier
/// in the program is offered to `fold(program, list, collective's index,
/// cast's index, id)`; where it agrees, the collective reads the cast's bf16
/// source instead and the cast goes.
template <typename IsBucket, typename Fold>
int64_t foldBucketCasts(rt::RankProgram &r, IsBucket isBucket, Fold fold) {
  int64_t changed = 0;
  for (auto &[name, list] : r.programs) {
    std::map<int64_t, size_t> castOf; // f32 result -> its cast
    std::vector<bool> dropped(list.size(), false);
    for (size_t j = 0; j < list.size(); ++j) {
      rt::Instruction &ins = list[j];
      if (widensBf16(r, ins))
        castOf[ins.out[0]] = j;
      if (!isBucket(ins))
        continue;
      for (int64_t &id : ins.in) {
        auto it = castOf.find(id);
        if (it == castOf.end() || dropped[it->second] || !fold(name, list, j, it->second, id))
          continue;
        id = list[it->second].in[0];
        dropped[it->second] = true;
        ++changed;
      }
    }
    eraseMarked(list, dropped);
  }
  return changed;
}

/// Data parallelism averages each gradient in f32: a cast widens the bf16
/// gradient into an f32 copy and its bucket's async all-reduce averages the
/// copies in place. The all-reduce reads the bf16 gradients instead: it
/// widens them (exactly) as it packs its one message, and writes the means
/// into the same f32 buffers, without a cast kernel per gradient per step
/// (ResNet-50: 161). The bf16 gradients then live until the bucket's event
/// is waited for (loom-plan-memory), as the f32 copies already did. A bf16
/// gradient may be a view: a bias's gradient is a reduce_sum's [1, 1, n]
/// result seen as [n] (GPT-2 350M: 97 of them a step); the storage it views
/// is written once, and loom-plan-memory keeps storages, not views, alive.
int64_t bucketsWidenBf16Gradients(rt::RankProgram &r) {
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  auto [reads, writes, readIn] = accessesOf(r);
  std::set<int64_t> kept = keptBuffers(r), viewed = viewedBuffers(r);
  auto isBucket = [](const rt::Instruction &ins) {
    return ins.op == "all_reduce" && ins.in == ins.out && flagAttr(ins, "async") && ins.attrs.contains("event");
  };
  auto fold = [&](const std::string &name, const std::vector<rt::Instruction> &list, size_t j, size_t at,
                  int64_t id) {
    // Written by its cast and this all-reduce only.
    if (writes[id] != 2 || r.buffers[id].viewOf >= 0 || viewed.count(id))
      return false;
    int64_t source = list[at].in[0], storage = root(source);
    // Read by its cast alone, its storage written once and not kept
    // past the step (an output, or a parameter's gradient); a view (a
    // bias's gradient), or a buffer nothing views.
    if (reads[source] != 1 || writes[storage] != 1 || kept.count(source) || kept.count(storage) ||
        (source == storage && viewed.count(source)) || r.buffers[source].shape != r.buffers[id].shape)
      return false;
    // Nothing else reads the f32 copy before the all-reduce writes it:
    // in this program only after it, elsewhere only in the update.
    for (size_t k = at + 1; k < j; ++k)
      for (int64_t x : list[k].in)
        if (root(x) == id)
          return false;
    for (const std::string &p : readIn[id])
      if (p != name && p != "update")
        return false;
    return true;
  };
  return foldBucketCasts(r, isBucket, fold);
}

/// ZeRO-1's buckets the same way: a reduce-scatter reads each bf16
/// gradient, widened as its bucket is packed, instead of an f32 copy that a
/// cast per gradient wrote and nothing else reads (GPT-2 350M: 291 casts a
/// step, 1.4 GB written and 0.7 GB read). The parameter's gradient, which
/// the C API reads, becomes the bf16 one, as on one device.
int64_t shardedBucketsReadBf16Gradients(rt::RankProgram &r) {
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  auto [reads, writes, readIn] = accessesOf(r);
  std::set<int64_t> kept = keptBuffers(r), viewed = viewedBuffers(r), outputs;
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  std::map<int64_t, rt::Parameter *> paramOfGrad;
  for (rt::Parameter &p : r.params)
    if (p.grad >= 0)
      paramOfGrad[p.grad] = &p;
  auto isBucket = [](const rt::Instruction &ins) {
    return ins.op == "reduce_scatter" && ins.in.size() == ins.out.size() && flagAttr(ins, "async") &&
           ins.attrs.contains("event");
  };
  auto fold = [&](const std::string &, const std::vector<rt::Instruction> &list, size_t, size_t at, int64_t id) {
    // The f32 copy: written by its cast, read by this reduce-scatter alone,
    // a parameter's gradient or nothing kept.
    if (writes[id] != 1 || reads[id] != 1 || r.buffers[id].viewOf >= 0 || viewed.count(id) || outputs.count(id) ||
        (kept.count(id) && !paramOfGrad.count(id)))
      return false;
    int64_t source = list[at].in[0], storage = root(source);
    if (reads[source] != 1 || writes[storage] != 1 || kept.count(source) || kept.count(storage) ||
        outputs.count(source) || (source == storage && viewed.count(source)) ||
        r.buffers[source].shape != r.buffers[id].shape)
      return false;
    if (auto p = paramOfGrad.find(id); p != paramOfGrad.end())
      p->second->grad = source;
    return true;
  };
  return foldBucketCasts(r, isBucket, fold);
}

/// --grad-reduce bf16: a bucket whose bf16 gradients are widened into f32
/// means that only the update reads (the clipping norm and the optimizer,
/// which read bf16 gradients as well) averages them in place instead, as
/// bf16, and the update reads the bf16 means: the same values (a bf16 mean
/// widens exactly), without the f32 copies, their memory, or a kernel
/// widening each bucket beside the backward (ResNet-50: 25.6M gradients a
/// step, 102 MB written). A bucket is rewritten whole or not at all: each
/// of its tensors is then f32 or bf16 in place.
int64_t bucketsAverageBf16InPlace(rt::RankProgram &r) {
  if (!r.programs.count("update"))
    return 0;
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  Accesses accesses = accessesOf(r);
  std::map<int64_t, int64_t> &reads = accesses.reads, &writes = accesses.writes;
  std::set<int64_t> kept = keptBuffers(r), viewed = viewedBuffers(r);
  // Who reads each f32 mean: only the update's norm and optimizer may.
  std::map<int64_t, std::vector<std::pair<std::string, size_t>>> readers;
  for (const auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size(); ++i)
      for (int64_t id : list[i].in)
        readers[id].push_back({name, i});
  std::set<int64_t> outputs;
  for (const rt::NamedBuffer &nb : r.outputs)
    outputs.insert(nb.buffer);
  std::map<int64_t, rt::Parameter *> paramOfGrad;
  for (rt::Parameter &p : r.params)
    if (p.grad >= 0)
      paramOfGrad[p.grad] = &p;
  int64_t changed = 0;
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      if (ins.op != "all_reduce" || ins.in.size() != ins.out.size() || !flagAttr(ins, "async"))
        continue;
      bool eligible = true, widens = false;
      for (size_t i = 0; i < ins.in.size() && eligible; ++i) {
        int64_t in = ins.in[i], out = ins.out[i];
        if (in == out) { // already in place: f32 (a sum over stages or microbatches)
          eligible = r.buffers[in].dtype == LOOM_F32;
          continue;
        }
        widens = true;
        const rt::Buffer &ib = r.buffers[in], &ob = r.buffers[out];
        eligible = ib.dtype == LOOM_BF16 && ob.dtype == LOOM_F32 && ib.shape == ob.shape && ob.viewOf < 0 &&
                   !viewed.count(out) && !outputs.count(out) && writes[out] == 1 && paramOfGrad.count(out) &&
                   reads[in] == 1 && writes[root(in)] == 1 && !kept.count(in) && !kept.count(root(in));
        for (auto [program, at] : readers[out]) {
          const std::string &op = r.programs[program][at].op;
          eligible &= program == "update" && (op == "global_norm" || op == "adamw" || op == "sgd");
        }
      }
      if (!eligible || !widens)
        continue;
      for (size_t i = 0; i < ins.in.size(); ++i) {
        int64_t in = ins.in[i], out = ins.out[i];
        if (in == out)
          continue;
        for (auto [program, at] : readers[out])
          for (int64_t &id : r.programs[program][at].in)
            if (id == out)
              id = in;
        paramOfGrad[out]->grad = in;
        ins.out[i] = in;
      }
      ++changed;
    }
  return changed;
}

/// --grad-reduce bf16: each bucket that widens bf16 gradients averages
/// them as bf16 on the wire ("wire" = "bf16"), half the bytes; its f32
/// inputs stay f32.
int64_t bucketsReduceInBf16(rt::RankProgram &r) {
  int64_t marked = 0;
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      if (ins.op != "all_reduce" || ins.in.size() != ins.out.size())
        continue;
      bool widens = false;
      for (size_t i = 0; i < ins.in.size(); ++i)
        widens |= r.buffers[ins.in[i]].dtype == LOOM_BF16 && r.buffers[ins.out[i]].dtype == LOOM_F32;
      if (widens) {
        ins.attrs["wire"] = "bf16";
        ++marked;
      }
    }
  return marked;
}

/// Gradient sums over microbatches start as zeros (a fill at the start of
/// the step) and add each microbatch's gradient. The first add of each sum
/// becomes a cast of that gradient into it (exact: 0 + x is x), without the
/// fill: one pass over the sum fewer, and no read of it (GPT-2 350M, two
/// microbatches: 295 fills and as many adds a step).
int64_t firstAccumulationsCast(rt::RankProgram &r) {
  auto root = [&](int64_t id) { return rt::storageOf(r, id); };
  int64_t changed = 0;
  for (auto &[name, list] : r.programs) {
    std::vector<bool> dropped(list.size(), false);
    for (size_t i = 0; i < list.size(); ++i) {
      const rt::Instruction &fill = list[i];
      if (fill.op != "fill" || fill.in.size() != 0 || fill.out.size() != 1 || r.buffers[fill.out[0]].viewOf >= 0 ||
          !fill.attrs.is_object() || !fill.attrs.contains("value") || !fill.attrs["value"].is_number() ||
          fill.attrs["value"].get<double>() != 0.0)
        continue;
      int64_t sum = fill.out[0];
      size_t j = i + 1;
      auto touches = [&](const rt::Instruction &ins) {
        for (const std::vector<int64_t> *ids : {&ins.in, &ins.out})
          for (int64_t id : *ids)
            if (root(id) == sum)
              return true;
        return false;
      };
      while (j < list.size() && !touches(list[j]))
        ++j;
      if (j == list.size())
        continue;
      rt::Instruction &add = list[j];
      if (add.op != "add" || add.in.size() != 2 || add.out.size() != 1 || add.out[0] != sum ||
          (add.in[0] == sum) == (add.in[1] == sum))
        continue;
      int64_t g = add.in[0] == sum ? add.in[1] : add.in[0];
      const rt::Buffer &gb = r.buffers[g], &sb = r.buffers[sum];
      if (root(g) == sum || gb.shape != sb.shape || (gb.dtype != LOOM_F32 && gb.dtype != LOOM_BF16) ||
          sb.dtype != LOOM_F32)
        continue;
      add = rt::Instruction{"cast", {g}, {sum}, json::object()};
      dropped[i] = true;
      ++changed;
    }
    eraseMarked(list, dropped);
  }
  return changed;
}

/// A pipelined step runs every microbatch's forward, each casting the same
/// weights to bf16 again. The weights do not change within the step, so the
/// first cast of each serves every microbatch (their bf16 copies then live
/// the whole step, as one microbatch's do).
int64_t castWeightsOncePerStep(rt::RankProgram &r) {
  auto it = r.programs.find("step");
  if (it == r.programs.end())
    return 0;
  std::set<int64_t> params;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  std::map<std::pair<int64_t, int>, int64_t> first; // (weight, dtype) -> its first cast's result
  std::map<int64_t, int64_t> rename;
  std::vector<rt::Instruction> kept;
  for (rt::Instruction &ins : it->second) {
    for (int64_t &id : ins.in)
      if (auto to = rename.find(id); to != rename.end())
        id = to->second;
    if (ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1 && params.count(ins.in[0]) &&
        r.buffers[ins.out[0]].viewOf < 0) {
      auto [at, inserted] = first.try_emplace({ins.in[0], int(r.buffers[ins.out[0]].dtype)}, ins.out[0]);
      if (!inserted) {
        rename[ins.out[0]] = at->second;
        continue;
      }
    }
    kept.push_back(std::move(ins));
  }
  for (rt::Buffer &b : r.buffers) // views of a dropped copy view the kept one
    if (b.viewOf >= 0)
      if (auto to = rename.find(b.viewOf); to != rename.end())
        b.viewOf = to->second;
  for (auto &[name, list] : r.programs) // other programs (update) read the kept copy
    if (name != "step")
      for (rt::Instruction &ins : list)
        for (int64_t &id : ins.in)
          if (auto to = rename.find(id); to != rename.end())
            id = to->second;
  int64_t dropped = int64_t(it->second.size() - kept.size());
  it->second = std::move(kept);
  return dropped;
}

/// Training bundles cast each f32 master weight to bf16 where the forward
/// first uses it. The casts move to the start of the forward, next to each
/// other, where the runtime converts them all in one launch. Memory stays
/// as it was: the matrices' bf16 copies are kept for the backward anyway,
/// and the rest (biases, norm shifts, tables read once at the start) are
/// small or first read at the start.
int64_t hoistParameterCasts(rt::RankProgram &r) {
  if (!r.programs.count("forward") || !r.programs.count("backward"))
    return 0;
  std::set<int64_t> params;
  for (const rt::Parameter &p : r.params)
    params.insert(p.buffer);
  std::vector<rt::Instruction> &forward = r.programs["forward"], front, rest;
  for (rt::Instruction &ins : forward) {
    bool hoist = ins.op == "cast" && ins.in.size() == 1 && ins.out.size() == 1 && params.count(ins.in[0]);
    (hoist ? front : rest).push_back(std::move(ins));
  }
  int64_t moved = int64_t(front.size());
  front.insert(front.end(), std::make_move_iterator(rest.begin()), std::make_move_iterator(rest.end()));
  forward = std::move(front);
  return moved;
}

struct Bf16StepCastsPass : mlir::loom::impl::Bf16StepCastsBase<Bf16StepCastsPass> {
  void runOnOperation() override {
    FailureOr<BundleOptions> options = getCompileOptions(getOperation());
    if (failed(options))
      return signalPassFailure();
    bool reduceBf16 = options->gradReduceBf16;
    auto rewrite = [&](StepRank &rank) {
      castWeightsOncePerStep(rank.program);
      optimizerReadsBf16Gradients(rank.program);
      addsReadBf16Gradients(rank.program);
      bucketsWidenBf16Gradients(rank.program);
      shardedBucketsReadBf16Gradients(rank.program);
      if (reduceBf16) {
        bucketsAverageBf16InPlace(rank.program);
        bucketsReduceInBf16(rank.program);
      }
      firstAccumulationsCast(rank.program);
      hoistParameterCasts(rank.program);
    };
    if (failed(updateEachRank(getOperation(), getArgument(), rewrite)))
      signalPassFailure();
  }
};

} // namespace

//===- MemoryModel.cpp - A stage's memory as the compiler plans it --------===//

#include "compiler/planner/MemoryModel.h"

#include <algorithm>
#include <set>

namespace loom::planner {

StageMemory stageMemory(const std::vector<std::vector<LayerMemory>> &chunks, const ParameterBytes &bytes,
                        const StageSchedule &schedule) {
  // A tensor two layers of the stage share (tied embeddings) is stored once
  // and has one gradient, made by the backward that reaches it first: the
  // later layer's.
  std::vector<std::vector<double>> gradParams(chunks.size());
  std::set<std::string> seen;
  double params = 0, copies = 0, kept = 0, waiting = 0;
  for (size_t c = chunks.size(); c-- > 0;) {
    gradParams[c].resize(chunks[c].size());
    for (size_t k = chunks[c].size(); k-- > 0;) {
      const LayerMemory &l = chunks[c][k];
      gradParams[c][k] = l.params;
      for (const auto &[name, elements] : l.tied)
        if (!seen.insert(name).second)
          gradParams[c][k] -= elements;
      params += gradParams[c][k];
      copies += l.params; // each reader of a tied tensor casts its own copy
      kept += l.keptBytes;
      waiting += l.deferredBytes;
    }
  }
  StageMemory out;
  out.persistentBytes = params * bytes.persistent;
  bool summed = schedule.microbatched;
  // Copies the update writes are persistent (one per tensor of the stage):
  // none are cast in the step.
  double workingCopy = bytes.copiesKept ? 0.0 : bytes.workingCopy;
  // Accumulated over microbatches, every gradient and every weight copy
  // lives through the step.
  double wholeStep = summed ? copies * workingCopy + params * bytes.gradient : 0;
  double others = (schedule.inFlight - 1) * kept + schedule.deferred * waiting;

  // The backward visits the layers last to first. While it runs layer i,
  // the other microbatches in flight hold all they keep, those waiting for
  // their weight gradients what those read, this one what the layers up to
  // i keep, and layer i's backward its own working set; the gradients it
  // makes appear as it ends, when its activations are gone. With one
  // microbatch the gradients of the layers after i exist, and the weight
  // copies of the layers up to i (a recomputed layer casts its weights again
  // in its backward); with several, the new gradients of the chunk's layers
  // after i, which wait for the chunk's backward to end to be summed, unless
  // ZB-H1 makes them in a task of their own.
  double keptBelow = 0, copiesBelow = 0, gradsAbove = params;
  for (size_t c = 0; c < chunks.size(); ++c) {
    double chunkGrads = 0, chunkWaiting = 0;
    for (size_t i = 0; i < chunks[c].size(); ++i)
      chunkGrads += gradParams[c][i], chunkWaiting += chunks[c][i].deferredBytes;
    double chunkAbove = schedule.weightTaskApart ? 0 : chunkGrads;
    for (size_t i = 0; i < chunks[c].size(); ++i) {
      const LayerMemory &l = chunks[c][i];
      double newGrads = schedule.weightTaskApart ? 0 : gradParams[c][i];
      // Gradients after layer i, and after layer i's backward those of i too.
      auto grads = [&](double own) {
        return summed ? (chunkAbove - newGrads + own) * bytes.newGradient
                      : (gradsAbove - gradParams[c][i] + own) * bytes.gradient + bytes.gradientsInFlight;
      };
      double copiesUpTo = summed ? 0 : (copiesBelow + l.backwardReadParams) * workingCopy;
      double copiesBefore = summed ? 0 : copiesBelow * workingCopy;
      double during = others + keptBelow + l.keptBytes + l.backwardBytes + copiesUpTo + grads(0) +
                      bytes.weightsInFlight;
      double after = others + keptBelow + copiesBefore + grads(summed ? newGrads : gradParams[c][i]) +
                     bytes.weightsInFlight;
      out.peakBytes = std::max(out.peakBytes, wholeStep + std::max(during, after));
      keptBelow += l.keptBytes;
      if (!l.recomputed)
        copiesBelow += l.backwardReadParams;
      gradsAbove -= gradParams[c][i];
      chunkAbove -= newGrads;
    }
    // ZB-H1's weight task of a microbatch turns what it read into new
    // gradients, layer by layer: it holds at most the larger of the two.
    if (schedule.weightTaskApart)
      out.peakBytes = std::max(out.peakBytes,
                               others + wholeStep + std::max(chunkWaiting, chunkGrads * bytes.newGradient));
  }
  return out;
}

} // namespace loom::planner

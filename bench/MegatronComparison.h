//===- MegatronComparison.h - Planner vs published Megatron-LM runs -*- C++ -*-===//
//
// For each published configuration (Narayanan et al., SC21, Table 1 on A100
// 80GB), builds the GPT model through the real path (model zoo -> IR ->
// ModelSpec), predicts the step time of the published dp/tp/pp with full
// recomputation, converts it to TFLOP/s per GPU with the paper's own formula,
// and lets the planner search freely for comparison. One cluster description
// (the a100-80g preset) and one set of cost-model constants serve every row.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_BENCH_MEGATRONCOMPARISON_H
#define LOOM_BENCH_MEGATRONCOMPARISON_H

#include "compiler/ModelZoo.h"
#include "compiler/PlannerModel.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

namespace loom::bench {

struct MegatronRow {
  std::string model;
  int64_t layers, hidden, heads, gpus, tp, pp, dp, batch;
  double publishedTflops;
  double predictedTflops = 0;     // published configuration, as predicted
  double predictedStepS = 0;
  std::string publishedPlan;      // the rest of the published config the planner filled in
  double chosenStepS = 0;         // the planner's own choice
  double chosenTflops = 0;        // paper formula over the chosen step (same work)
  std::string chosenPlan;
  double searchSeconds = 0;
  std::string error;
};

/// The paper's FLOPs per iteration (with full recomputation):
/// 96 B s l h^2 (1 + s / 6h + V / 16 l h).
inline double megatronFlops(double B, double s, double l, double h, double V) {
  return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
}

inline std::vector<MegatronRow> runMegatronComparison(const std::string &dataPath,
                                                      std::string &error) {
  std::ifstream in(dataPath);
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, false);
  if (doc.is_discarded()) {
    error = "cannot read " + dataPath;
    return {};
  }
  int64_t seq = doc["model"]["seq"], vocab = doc["model"]["vocab"];
  std::vector<MegatronRow> rows;
  mlir::MLIRContext context;
  context.loadDialect<mlir::loom::LoomDialect, mlir::func::FuncDialect>();
  for (auto &r : doc["rows"]) {
    MegatronRow row{r["model"], r["layers"], r["hidden"], r["heads"], r["gpus"], r["tp"],
                    r["pp"],    r["dp"],     r["global_batch"], r["tflops_per_gpu"]};
    mlir::loom::ModelConfig config;
    config.family = "gpt";
    config.layers = row.layers, config.hidden = row.hidden, config.heads = row.heads;
    config.seq = seq, config.vocab = vocab, config.dtype = "bf16";
    std::string text, err = mlir::loom::applyDefaults(config);
    if (!err.empty() || !mlir::loom::writeModel(config, text, err)) {
      row.error = err;
      rows.push_back(row);
      continue;
    }
    auto module = mlir::parseSourceString<mlir::ModuleOp>(text, &context);
    auto spec = mlir::loom::buildModelSpec(*module, "gpt-" + row.model);
    planner::Cluster cluster;
    if (!planner::parseCluster("a100-80g:8x" + std::to_string(row.gpus / 8), cluster, err)) {
      row.error = err;
      rows.push_back(row);
      continue;
    }
    planner::CostOptions costs;
    costs.materializedAttention = true;   // 2021: no flash attention
    costs.overlapGradientReduce = false;  // 2021: gradient all-reduce after the pipeline flush
    costs.zeroBubbleSchedule = false;     // 2021: 1F1B and interleaved 1F1B
    costs.pipelineSendsOverlap = false;   // 2021: blocking sends and receives between stages
    costs.accumulateInProducts = false;   // 2021: gradients added to their fp32 sums after each product
    costs.zeroPackedCollectives = true;   // sharded optimizer states collected per bucket, not Loom's per tensor
    costs.zeroPackBytesPerParam = 0;      // contiguous gradient and parameter buffers: nothing to pack
    planner::Planner planner(*spec, cluster, costs);
    planner::Constraints published;
    published.dp = row.dp, published.tp = row.tp, published.pp = row.pp;
    published.recompute = planner::Recompute::Full;
    planner::PlanResult pub = planner.search(row.batch, published);
    double work = megatronFlops(row.batch, seq, row.layers, row.hidden, vocab);
    if (!pub.found) {
      row.error = pub.error;
    } else {
      row.predictedStepS = pub.best.stepTime;
      row.predictedTflops = work / pub.best.stepTime / row.gpus / 1e12;
      row.publishedPlan = pub.best.shortName();
    }
    planner::PlanResult free = planner.search(row.batch);
    row.searchSeconds = free.searchSeconds;
    if (free.found) {
      row.chosenStepS = free.best.stepTime;
      row.chosenTflops = work / free.best.stepTime / row.gpus / 1e12;
      row.chosenPlan = free.best.shortName();
    }
    rows.push_back(row);
  }
  return rows;
}

} // namespace loom::bench

#endif

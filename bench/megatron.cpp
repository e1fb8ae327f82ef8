//===- megatron.cpp - Print the planner vs published Megatron-LM table ----===//
//
// usage: loom-bench-megatron [DATA.json]   (default: bench/data/megatron-2021-a100.json)

#include "bench/MegatronComparison.h"

#include <cmath>
#include <cstdio>

int main(int argc, char **argv) {
  std::string error;
  auto rows = loom::bench::runMegatronComparison(argc > 1 ? argv[1] : LOOM_MEGATRON_DATA, error);
  if (!error.empty()) {
    std::fprintf(stderr, "loom-bench-megatron: error: %s\n", error.c_str());
    return 1;
  }
  std::printf("| model | GPUs | t | p | d | batch | published TFLOP/s | predicted | error | "
              "chosen plan | chosen TFLOP/s* | search |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |\n");
  double worst = 0;
  for (auto &r : rows) {
    if (!r.error.empty()) {
      std::printf("| %s | error: %s |\n", r.model.c_str(), r.error.c_str());
      continue;
    }
    double err = r.predictedTflops / r.publishedTflops - 1;
    worst = std::max(worst, std::abs(err));
    std::printf("| %s | %lld | %lld | %lld | %lld | %lld | %.0f | %.0f | %+.1f%% | %s | %.0f | %.0f ms |\n",
                r.model.c_str(), (long long)r.gpus, (long long)r.tp, (long long)r.pp,
                (long long)r.dp, (long long)r.batch, r.publishedTflops, r.predictedTflops, err * 100,
                r.chosenPlan.c_str(), r.chosenTflops, r.searchSeconds * 1e3);
  }
  std::printf("\nworst |error| %.1f%%. *chosen TFLOP/s: the paper's FLOP count (with full "
              "recomputation) over the chosen plan's step time, so both columns measure the "
              "same work.\n", worst * 100);
  return 0;
}

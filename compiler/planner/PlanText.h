//===- PlanText.h - Units as the planner prints them -----------*- C++ -*-===//
#ifndef LOOM_COMPILER_PLANNER_PLANTEXT_H
#define LOOM_COMPILER_PLANNER_PLANTEXT_H

#include <string>

namespace loom::planner {

constexpr double kGiB = double(1ull << 30);
/// "12.6 GiB"
std::string gib(double bytes);
/// "55.7 ms" ("0.08 ms" below 10 ms: two decimals)
std::string ms(double seconds);

} // namespace loom::planner

#endif

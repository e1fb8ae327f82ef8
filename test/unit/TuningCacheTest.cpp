//===- TuningCacheTest.cpp - LOOM_TUNING_CACHE's file ---------------------===//
//
// Choices stored by one process are read by the next; what another process
// stored meanwhile is kept; a file that is not a tuning cache is neither
// used nor touched; a cache that cannot be written keeps its entries in
// memory. No GPU needed: the cache stores JSON values under string keys.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/TuningCache.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

using loom::rt::TuningCache;

namespace {

std::string fresh(const std::string &name) {
  std::string path = ::testing::TempDir() + "/" + name;
  std::remove(path.c_str());
  return path;
}

std::string contents(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

} // namespace

TEST(TuningCache, ChoicesReadByTheNextProcess) {
  std::string path = fresh("tuning-next.json");
  {
    TuningCache first(path);
    EXPECT_FALSE(first.lookup("conv a").has_value());
    first.store("conv a", {{"plan", 3}, {"ms", 0.25}});
    EXPECT_EQ(first.problem(), "");
  }
  TuningCache second(path);
  auto got = second.lookup("conv a");
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ((*got)["plan"], 3);
  EXPECT_FALSE(second.lookup("conv b").has_value());
}

TEST(TuningCache, OtherProcessesEntriesKept) {
  std::string path = fresh("tuning-merge.json");
  TuningCache a(path), b(path);
  EXPECT_FALSE(a.lookup("x").has_value()); // both read the empty file first
  EXPECT_FALSE(b.lookup("y").has_value());
  a.store("x", 1);
  b.store("y", 2);
  TuningCache c(path);
  EXPECT_EQ(c.lookup("x").value_or(0), 1);
  EXPECT_EQ(c.lookup("y").value_or(0), 2);
}

TEST(TuningCache, ForeignFileNeitherUsedNorTouched) {
  for (std::string text : {std::string("not json at all"), std::string("{\"format\": \"something else\"}"),
                           std::string("{\"format\": \"loom-tuning-cache\", \"version\": 99, \"entries\": {}}")}) {
    SCOPED_TRACE(text);
    std::string path = fresh("tuning-foreign.json");
    std::ofstream(path) << text;
    TuningCache cache(path);
    EXPECT_FALSE(cache.lookup("k").has_value());
    cache.store("k", 5);
    EXPECT_EQ(cache.lookup("k").value_or(0), 5); // kept for this process
    EXPECT_NE(cache.problem().find(path), std::string::npos) << cache.problem();
    EXPECT_EQ(contents(path), text);
  }
}

TEST(TuningCache, UnwritableCacheKeepsItsEntriesInMemory) {
  std::string path = ::testing::TempDir() + "/no-such-directory/tuning.json";
  TuningCache cache(path);
  cache.store("k", 7);
  EXPECT_EQ(cache.lookup("k").value_or(0), 7);
  EXPECT_NE(cache.problem().find("cannot write"), std::string::npos) << cache.problem();
}

TEST(TuningCache, NoFileNoCache) {
  TuningCache none("");
  none.store("k", 1);
  EXPECT_EQ(none.problem(), "");
}

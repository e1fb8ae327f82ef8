//===- ClusterTest.cpp - Cluster presets and files ------------------------===//

#include "compiler/planner/Cluster.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

using namespace loom::planner;

TEST(Cluster, PresetOneNode) {
  Cluster c;
  std::string error;
  ASSERT_TRUE(parseCluster("h100:2", c, error)) << error;
  EXPECT_EQ(c.device.name, "h100");
  EXPECT_EQ(c.numDevices(), 2);
  EXPECT_EQ(c.nodes, 1);
  EXPECT_DOUBLE_EQ(c.peakFlops("bf16"), 9.89e14);
  EXPECT_DOUBLE_EQ(c.device.memoryBytes, 80.0 * (1ull << 30));
}

TEST(Cluster, PresetNodesByCount) {
  Cluster c;
  std::string error;
  ASSERT_TRUE(parseCluster("a100-80g:32", c, error)) << error;
  EXPECT_EQ(c.devicesPerNode, 8);
  EXPECT_EQ(c.nodes, 4);
  ASSERT_TRUE(parseCluster("h100:8x4", c, error)) << error;
  EXPECT_EQ(c.numDevices(), 32);
  EXPECT_EQ(c.describe(), "32 x h100 (4 nodes of 8)");
  ASSERT_TRUE(parseCluster("cpu:4", c, error)) << error;
  EXPECT_EQ(c.numDevices(), 4);
}

TEST(Cluster, FallsBackToF32Peak) {
  Cluster c;
  std::string error;
  ASSERT_TRUE(parseCluster("cpu:1", c, error)) << error;
  EXPECT_DOUBLE_EQ(c.peakFlops("f64"), c.peakFlops("f32"));
}

TEST(Cluster, RejectsBadPresets) {
  Cluster c;
  std::string error;
  EXPECT_FALSE(parseCluster("v100:8", c, error));
  EXPECT_NE(error.find("unknown device 'v100'"), std::string::npos) << error;
  EXPECT_NE(error.find("h100"), std::string::npos) << "should list the presets: " << error;
  EXPECT_FALSE(parseCluster("h100:0", c, error));
  EXPECT_NE(error.find("positive"), std::string::npos) << error;
  EXPECT_FALSE(parseCluster("h100:16x2", c, error));
  EXPECT_NE(error.find("at most 8"), std::string::npos) << error;
  EXPECT_FALSE(parseCluster("h100:12", c, error));
  EXPECT_NE(error.find("GxK"), std::string::npos) << error;
  EXPECT_FALSE(parseCluster("h100:abc", c, error));
  EXPECT_FALSE(parseCluster("/nonexistent/cluster.json", c, error));
  EXPECT_NE(error.find("neither a preset"), std::string::npos) << error;
}

static std::string writeTemp(const std::string &text) {
  std::string path = ::testing::TempDir() + "/cluster-" +
                     ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".json";
  std::ofstream(path) << text;
  return path;
}

TEST(Cluster, JsonFileWithPresetDevice) {
  Cluster c;
  std::string error;
  std::string path = writeTemp(R"({"device": "h100", "devices_per_node": 4, "nodes": 2})");
  ASSERT_TRUE(parseCluster(path, c, error)) << error;
  EXPECT_EQ(c.numDevices(), 8);
  std::remove(path.c_str());
}

TEST(Cluster, JsonFileWithCustomDevice) {
  Cluster c;
  std::string error;
  std::string path = writeTemp(R"({"name": "mygpu", "devices_per_node": 4, "nodes": 1,
    "device": {"peak_flops": {"bf16": 1e14}, "memory_bytes": 1e10, "memory_bandwidth": 1e12,
               "intra_node_bandwidth": 1e11, "intra_node_latency": 1e-6,
               "inter_node_bandwidth": 1e10, "inter_node_latency": 1e-5, "gpus_per_node": 4}})");
  ASSERT_TRUE(parseCluster(path, c, error)) << error;
  EXPECT_EQ(c.device.name, "mygpu");
  EXPECT_DOUBLE_EQ(c.peakFlops("bf16"), 1e14);
  std::remove(path.c_str());
}

TEST(Cluster, MalformedJsonSaysWhy) {
  Cluster c;
  std::string error;
  std::string path = writeTemp("{not json");
  EXPECT_FALSE(parseCluster(path, c, error));
  EXPECT_NE(error.find("not valid JSON"), std::string::npos) << error;
  path = writeTemp(R"({"device": {"peak_flops": {"bf16": 1e14}}, "devices_per_node": 1, "nodes": 1})");
  EXPECT_FALSE(parseCluster(path, c, error));
  EXPECT_NE(error.find("memory_bytes"), std::string::npos) << error;
  path = writeTemp(R"({"device": "h100", "devices_per_node": 0, "nodes": 1})");
  EXPECT_FALSE(parseCluster(path, c, error));
  EXPECT_NE(error.find("devices_per_node"), std::string::npos) << error;
  std::remove(path.c_str());
}

TEST(Cluster, DeviceCountsAreWholeNumbers) {
  // 0.5 devices per node used to truncate to a cluster of no devices, which
  // the planner then reported without naming the file or the field.
  Cluster c;
  std::string error;
  for (const char *counts : {R"("devices_per_node": 0.5, "nodes": 1)", R"("devices_per_node": 8, "nodes": 1e30)",
                             R"("devices_per_node": 8, "nodes": -2)", R"("devices_per_node": "8", "nodes": 1)"}) {
    std::string path = writeTemp(std::string(R"({"device": "h100", )") + counts + "}");
    EXPECT_FALSE(parseCluster(path, c, error)) << counts;
    EXPECT_EQ(error.rfind(path + ": field '", 0), 0u) << error;
    EXPECT_NE(error.find("must be a whole number from 1 to 999999999, got "), std::string::npos) << error;
    std::remove(path.c_str());
  }
}

// Found by fuzz/ClusterFuzzer.cpp: a field of the wrong type was an uncaught
// exception, and a count too large for int64 was converted anyway.
TEST(Cluster, FieldsOfTheWrongTypeOrSizeSayWhich) {
  Cluster c;
  std::string error;
  EXPECT_FALSE(parseClusterJson(R"({"name": 2, "device": {}, "devices_per_node": 1, "nodes": 1})",
                                "c.json", c, error));
  EXPECT_EQ(error, "c.json: field 'name' must be a string");
  EXPECT_FALSE(parseClusterJson(R"({"device": {"description": [], "peak_flops": {"bf16": 1}}})",
                                "c.json", c, error));
  EXPECT_EQ(error, "c.json: field 'description' must be a string");
  EXPECT_FALSE(parseClusterJson(R"({"device": "h100", "devices_per_node": 8, "nodes": 1e300})",
                                "c.json", c, error));
  EXPECT_EQ(error, "c.json: field 'nodes' must be a whole number from 1 to 999999999, got 1e+300");
  EXPECT_FALSE(parseClusterJson(R"({"device": "h100", "devices_per_node": 2.5, "nodes": 1})",
                                "c.json", c, error));
  EXPECT_NE(error.find("field 'devices_per_node' must be a whole number"), std::string::npos) << error;
  ASSERT_TRUE(parseClusterJson(R"({"device": "h100", "devices_per_node": 8.0, "nodes": 2})",
                               "c.json", c, error)) << error;
  EXPECT_EQ(c.numDevices(), 16);
}

//===- ModelZooTest.cpp - Model writers -----------------------------------===//

#include "compiler/ModelZoo.h"

#include <gtest/gtest.h>

using namespace mlir::loom;

static std::string write(ModelConfig c, std::string &error) {
  std::string text;
  std::string defaults = applyDefaults(c);
  if (!defaults.empty()) {
    error = defaults;
    return "";
  }
  return writeModel(c, text, error) ? text : "";
}

TEST(ModelZoo, DefaultsAreThePublishedSizes) {
  ModelConfig gpt{"gpt"};
  EXPECT_EQ(applyDefaults(gpt), "");
  EXPECT_EQ(gpt.layers, 12);
  EXPECT_EQ(gpt.hidden, 768);
  EXPECT_EQ(gpt.ffn, 3072);
  ModelConfig llama{"llama"};
  EXPECT_EQ(applyDefaults(llama), "");
  EXPECT_EQ(llama.kvHeads, 4);
}

TEST(ModelZoo, WritesTheBlockOnce) {
  std::string error;
  ModelConfig c{"gpt"};
  c.layers = 48;
  std::string text = write(c, error);
  ASSERT_FALSE(text.empty()) << error;
  EXPECT_EQ(text.find("loom.block @layer"), text.rfind("loom.block @layer"));
  EXPECT_NE(text.find("loom.repeat 48 @layer"), std::string::npos);
}

TEST(ModelZoo, RejectsInconsistentSizes) {
  std::string error;
  ModelConfig c{"gpt"};
  c.hidden = 100;
  c.heads = 3;
  EXPECT_TRUE(write(c, error).empty());
  EXPECT_NE(error.find("not divisible by --heads 3"), std::string::npos) << error;

  ModelConfig l{"llama"};
  l.heads = 32;
  l.kvHeads = 5;
  EXPECT_TRUE(write(l, error).empty());
  EXPECT_NE(error.find("--kv-heads 5"), std::string::npos) << error;

  ModelConfig d{"gpt"};
  d.dtype = "int8";
  EXPECT_TRUE(write(d, error).empty());
  EXPECT_NE(error.find("unknown dtype"), std::string::npos) << error;

  ModelConfig u{"transformer-xl"};
  EXPECT_TRUE(write(u, error).empty());
  EXPECT_NE(error.find("unknown model family"), std::string::npos) << error;
}

//===- ReplayMain.cpp - Run a fuzz target over files, without libFuzzer ---===//
//
// Builds without LOOM_FUZZ link each fuzz target with this main, so ctest
// replays the seed corpus and every regression input (fuzz/regressions/) on
// any compiler: `loom-fuzz-X FILE_OR_DIR...` runs the target once per file.
//
//===----------------------------------------------------------------------===//

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    fs::path arg(argv[i]);
    if (fs::is_directory(arg)) {
      for (const auto &entry : fs::recursive_directory_iterator(arg))
        if (entry.is_regular_file())
          files.push_back(entry.path());
    } else if (fs::is_regular_file(arg)) {
      files.push_back(arg);
    } else if (!fs::exists(arg) && arg.parent_path().filename() == "regressions") {
      continue; // no regression input for this target yet
    } else {
      std::fprintf(stderr, "%s: '%s' is neither a file nor a directory\n", argv[0], argv[i]);
      return 1;
    }
  }
  for (const fs::path &file : files) {
    std::ifstream in(file, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "running %s (%zu bytes)\n", file.c_str(), bytes.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size());
  }
  std::printf("%zu inputs ran without a crash\n", files.size());
  return 0;
}

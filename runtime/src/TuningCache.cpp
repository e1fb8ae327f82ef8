//===- TuningCache.cpp - Timed choices kept across processes --------------===//

#include "runtime/src/TuningCache.h"

#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h" // readWholeFile, writeFileAtomically

#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace loom::rt {

namespace {
constexpr const char *kFormat = "loom-tuning-cache";
constexpr int kVersion = 1;
} // namespace

TuningCache::TuningCache(std::string path) : path(std::move(path)) {}

TuningCache &TuningCache::process() {
  static TuningCache cache([] {
    const char *e = std::getenv("LOOM_TUNING_CACHE");
    return std::string(e ? e : "");
  }());
  return cache;
}

std::optional<nlohmann::json> TuningCache::read(std::string &whyNot) const {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec) && !ec)
    return nlohmann::json::object(); // a new cache
  std::vector<char> text;
  try {
    text = readWholeFile(path);
  } catch (const Error &e) {
    whyNot = std::string(e.what()) + "; the tuning cache is not used";
    return std::nullopt;
  }
  nlohmann::json doc = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || doc.value("format", "") != kFormat || !doc.contains("entries") ||
      !doc["entries"].is_object()) {
    whyNot = "'" + path + "' is not a Loom tuning cache (a JSON document with \"format\": \"" + kFormat +
             "\"); it is left as it is and not used: name another file in LOOM_TUNING_CACHE";
    return std::nullopt;
  }
  if (!doc["version"].is_number_integer() || doc["version"].get<int>() != kVersion) {
    whyNot = "'" + path + "' is a tuning cache of another version of Loom; it is left as it is and not used: " +
             "name another file in LOOM_TUNING_CACHE or remove it";
    return std::nullopt;
  }
  return doc["entries"];
}

void TuningCache::warn(const std::string &message) { std::fprintf(stderr, "loom: warning: %s\n", message.c_str()); }

void TuningCache::load() {
  if (loaded)
    return;
  loaded = true;
  if (path.empty()) {
    usable = false;
    return;
  }
  if (auto e = read(why))
    entries = std::move(*e);
  else {
    usable = false;
    warn(why);
  }
}

std::optional<nlohmann::json> TuningCache::lookup(const std::string &key) {
  std::lock_guard<std::mutex> lock(mutex);
  load();
  auto it = entries.find(key);
  if (it == entries.end())
    return std::nullopt;
  return *it;
}

void TuningCache::store(const std::string &key, const nlohmann::json &value) {
  std::lock_guard<std::mutex> lock(mutex);
  load();
  entries[key] = value;
  if (!usable)
    return;
  // What other processes stored since this one read the file is kept.
  std::string whyNot;
  std::optional<nlohmann::json> now = read(whyNot);
  if (!now) {
    usable = false, why = whyNot;
    warn(why);
    return;
  }
  for (auto &[k, v] : now->items())
    if (!entries.contains(k))
      entries[k] = v;
  std::string text = nlohmann::json{{"format", kFormat}, {"version", kVersion}, {"entries", entries}}.dump(1) + "\n";
  try {
    writeFileAtomically(path, text.data(), text.size());
  } catch (const std::exception &e) {
    usable = false;
    why = std::string("cannot write the tuning cache: ") + e.what();
    warn(why + " (choices are kept for this process only)");
  }
}

std::string TuningCache::problem() {
  std::lock_guard<std::mutex> lock(mutex);
  load();
  return path.empty() ? "" : why;
}

} // namespace loom::rt

//===- TuningCache.h - Timed choices kept across processes ------*- C++ -*-===//
//
// What the CUDA backend times once per shape (cuDNN's convolution engines)
// takes seconds to minutes at a process's start, and the timed choice can
// differ from one process to the next. With LOOM_TUNING_CACHE=FILE the
// choices are kept in FILE, a JSON document
//   {"format": "loom-tuning-cache", "version": 1, "entries": {KEY: VALUE}}
// where each KEY names everything the choice depends on (the library
// versions, the device's name, the shape) and VALUE is what its user
// stored. Later processes, and every rank of a process, read the choice
// instead of timing again, so ranks on alike GPUs run the same engines.
//
// The file is written whole through a temporary and a rename after each new
// entry, merged with what other processes wrote meanwhile (two processes
// storing at once may lose one's entry: it is timed again next time). A
// file that is not such a document is left as it is and not used, with a
// warning naming it; nothing here throws.
//
//===----------------------------------------------------------------------===//

#ifndef LOOM_RUNTIME_TUNINGCACHE_H
#define LOOM_RUNTIME_TUNINGCACHE_H

#include <nlohmann/json.hpp>

#include <mutex>
#include <optional>
#include <string>

namespace loom::rt {

class TuningCache {
public:
  /// A cache kept in `path` ("": none; lookups miss and stores do nothing).
  explicit TuningCache(std::string path);

  /// The process's cache: the file LOOM_TUNING_CACHE names, or none.
  static TuningCache &process();

  std::optional<nlohmann::json> lookup(const std::string &key);
  /// Keeps `value` under `key` and writes the file; a failure to write is
  /// reported once on stderr and the cache then keeps entries in memory.
  void store(const std::string &key, const nlohmann::json &value);

  /// Why the file is not used ("" when it is, or when there is none).
  std::string problem();

private:
  /// Reads the file once; a file that is absent is an empty cache.
  void load();
  /// The entries of the file as it is now, or why it cannot be used.
  std::optional<nlohmann::json> read(std::string &why) const;
  void warn(const std::string &message);

  std::string path;
  std::mutex mutex;
  bool loaded = false;
  bool usable = true; // the file is ours (or absent) and writable
  std::string why;    // why not usable
  nlohmann::json entries = nlohmann::json::object();
};

} // namespace loom::rt

#endif

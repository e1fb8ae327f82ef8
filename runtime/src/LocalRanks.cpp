//===- LocalRanks.cpp - Every rank of a bundle in this process ------------===//

#include "runtime/src/LocalRanks.h"

#include "loom/rt/Error.h"
#include "runtime/src/Communicator.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>

namespace loom::rt {

std::vector<std::unique_ptr<Session>> openLocalRanks(const std::string &bundleDir, SessionOptions options) {
  Manifest manifest = readManifest(bundleDir);
  int64_t n = static_cast<int64_t>(manifest.ranks.size());
  if (n > 1) {
    if (options.backend == "cuda") {
      std::vector<int> devices;
      for (int64_t k = 0; k < n; ++k)
        devices.push_back(static_cast<int>(k));
      options.nccl = makeNcclWorld(manifest, devices, -1, nullptr, options.timeoutSeconds);
    } else {
      options.comm = std::make_shared<InProcessCommunicator>(static_cast<int>(n), options.timeoutSeconds);
      if (options.threads == 0)
        options.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency() / n));
    }
  }
  std::vector<std::unique_ptr<Session>> ranks(static_cast<size_t>(n));
  std::vector<std::thread> loaders;
  std::mutex mutex;
  std::optional<Error> failed;
  for (int64_t k = 0; k < n; ++k)
    loaders.emplace_back([&, k] {
      SessionOptions mine = options;
      mine.rank = static_cast<int>(k);
      if (mine.nccl)
        mine.device = static_cast<int>(k);
      try {
        ranks[size_t(k)] = std::make_unique<Session>(bundleDir, mine);
      } catch (const Error &e) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failed)
          failed = Error(e.code, n > 1 ? cat("rank ", k, ": ", e.what()) : std::string(e.what()));
      } catch (const std::exception &e) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failed)
          failed = Error(LOOM_INTERNAL, cat(n > 1 ? cat("rank ", k, ": ") : std::string(), e.what()));
      }
    });
  for (std::thread &t : loaders)
    t.join();
  if (failed)
    throw *failed;
  return ranks;
}

} // namespace loom::rt

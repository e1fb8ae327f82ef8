# lit configuration for Loom: loom-opt and loomc checked with FileCheck.
import os
import lit.formats

config.name = "Loom"
config.test_format = lit.formats.ShTest(execute_external=True)
config.suffixes = [".mlir", ".test"]
config.excludes = ["unit", "Inputs", "lit.cfg.py", "lit.site.cfg.py.in", "CMakeLists.txt"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.loom_obj_root, "test")
# scripts/sanitize.sh runs test/runtime and test/training with its sanitized
# loom-run (LOOM_LIT_RUNTIME_DIR), writing their outputs apart from ctest's.
runtime_dir = os.environ.get("LOOM_LIT_RUNTIME_DIR", config.loom_runtime_dir)
if "LOOM_LIT_EXEC_ROOT" in os.environ:
    config.test_exec_root = os.environ["LOOM_LIT_EXEC_ROOT"]
config.environment["PATH"] = os.pathsep.join(
    [config.loom_tools_dir, runtime_dir, config.llvm_tools_dir, os.environ.get("PATH", "")])
# loom-serve is built where cpp-httplib is installed.
if os.path.exists(os.path.join(runtime_dir, "loom-serve")):
    config.available_features.add("loom-serve")
for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
    if var in os.environ:
        config.environment[var] = os.environ[var]
import sys
config.substitutions.append(("%python", sys.executable))
config.substitutions.append(("%models", os.path.join(config.loom_src_root, "models")))
config.substitutions.append(("%loom_obj", config.loom_obj_root))
config.substitutions.append(("%loom_src", config.loom_src_root))

# mpirun tests run where Loom was built with MPI; root (CI containers) may run it.
if getattr(config, "loom_have_mpi", False) and config.mpirun:
    config.available_features.add("mpi")
    config.substitutions.append(("%mpirun", config.mpirun + " --oversubscribe"))
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        config.environment[var] = "1"

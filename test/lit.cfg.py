# lit configuration for Loom: loom-opt and loomc checked with FileCheck.
import os
import lit.formats

config.name = "Loom"
config.test_format = lit.formats.ShTest(execute_external=True)
config.suffixes = [".mlir", ".test"]
config.excludes = ["unit", "Inputs", "lit.cfg.py", "lit.site.cfg.py.in", "CMakeLists.txt"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.loom_obj_root, "test")
config.environment["PATH"] = os.pathsep.join(
    [config.loom_tools_dir, config.loom_runtime_dir, config.llvm_tools_dir, os.environ.get("PATH", "")])
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

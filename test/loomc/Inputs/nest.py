"""Writes MLIR text nested N levels deep, for the nesting limit's tests.

  nest.py modules N   N nested `module {` (one level each)
  nest.py arrays N    an attribute of N nested arrays, in one module
  nest.py parens N    an affine map with N nested parentheses
  nest.py tuples N    a type attribute of N nested tuple<...>
  nest.py quoted N    a model whose strings and comments hold N brackets
"""
import sys

kind, n = sys.argv[1], int(sys.argv[2])
if kind == "modules":
    print("module {\n" * n + "}\n" * n, end="")
elif kind == "arrays":
    print("module attributes {test.x = " + "[" * n + "]" * n + "} {}")
elif kind == "parens":
    print("#m = affine_map<(d0) -> (" + "(" * n + "d0" + ")" * n + ")>\nmodule {}")
elif kind == "tuples":
    print("module attributes {test.x = " + "tuple<" * n + "i32" + ">" * n + "} {}")
elif kind == "quoted":
    print("// " + "[" * n)
    print('module attributes {loom.family = "mlp"} {')
    print('  func.func @forward(%x: tensor<2x4xf32> {loom.name = "' + "{(<[" * n + '"}) '
          "-> tensor<2x4xf32> {")
    print("    return %x : tensor<2x4xf32>")
    print("  }")
    print("}")
else:
    sys.exit("unknown kind " + kind)

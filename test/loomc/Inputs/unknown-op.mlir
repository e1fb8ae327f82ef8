func.func @forward(%x: tensor<2x8xf32>) -> tensor<2x8xf32> {
  %z = loom.frobnicate %x : tensor<2x8xf32>
  return %z : tensor<2x8xf32>
}

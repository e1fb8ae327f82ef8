// Row reductions over the last axis, for the generated row kernels
// (loomc compile --fuse): layernorm, rmsnorm and softmax of 512-wide rows.
module attributes {loom.family = "mlp"} {
  loom.param @w : tensor<512x512xf32> init <normal(0.05)>
  loom.param @g : tensor<512xf32> init <normal(1.0)>
  loom.param @b : tensor<512xf32> init <normal(0.1)>

  func.func @forward(%input: tensor<?x512xf32>) -> tensor<?x512xf32> {
    %g = loom.get @g : tensor<512xf32>
    %b = loom.get @b : tensor<512xf32>
    %w = loom.get @w : tensor<512x512xf32>
    %ln = loom.layernorm %input, %g, %b {eps = 1.0e-5 : f64} : tensor<?x512xf32>, tensor<512xf32>, tensor<512xf32>
    %rms = loom.rmsnorm %ln, %g {eps = 1.0e-6 : f64} : tensor<?x512xf32>, tensor<512xf32>
    %y = loom.matmul %rms, %w : tensor<?x512xf32>, tensor<512x512xf32>
    %p = loom.softmax %y {axis = -1} : tensor<?x512xf32>
    return %p : tensor<?x512xf32>
  }
}

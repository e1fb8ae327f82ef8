// MLP classifier: 784 inputs, 2 hidden layers of 256 with ReLU, 10 classes.
// Written by: loomc models mlp --layers 2 --hidden 256 --inputs 784 --classes 10 --dtype f32
module attributes {loom.family = "mlp"} {
  loom.param @in.w : tensor<784x256xf32> init <normal(0.0357143)>
  loom.param @in.b : tensor<256xf32> init <zeros>
  loom.param @out.w : tensor<256x10xf32> init <normal(0.0625)>
  loom.param @out.b : tensor<10xf32> init <zeros>

  loom.block @layer(%x: tensor<?x256xf32>) -> tensor<?x256xf32> {
    loom.param @w : tensor<256x256xf32> init <normal(0.0625)>
    loom.param @b : tensor<256xf32> init <zeros>
    %w = loom.get @w : tensor<256x256xf32>
    %b = loom.get @b : tensor<256xf32>
    %y0 = loom.matmul %x, %w : tensor<?x256xf32>, tensor<256x256xf32>
    %y1 = loom.add %y0, %b : tensor<?x256xf32>, tensor<256xf32>
    %y = loom.relu %y1 : tensor<?x256xf32>
    loom.yield %y : tensor<?x256xf32>
  }

  func.func @forward(%input: tensor<?x784xf32>) -> tensor<?x10xf32> {
    %wi = loom.get @in.w : tensor<784x256xf32>
    %bi = loom.get @in.b : tensor<256xf32>
    %x0 = loom.matmul %input, %wi : tensor<?x784xf32>, tensor<784x256xf32>
    %x1 = loom.add %x0, %bi : tensor<?x256xf32>, tensor<256xf32>
    %x2 = loom.relu %x1 : tensor<?x256xf32>
    %x = loom.repeat 2 @layer(%x2) : (tensor<?x256xf32>) -> tensor<?x256xf32>
    %wo = loom.get @out.w : tensor<256x10xf32>
    %bo = loom.get @out.b : tensor<10xf32>
    %l0 = loom.matmul %x, %wo : tensor<?x256xf32>, tensor<256x10xf32>
    %logits = loom.add %l0, %bo : tensor<?x10xf32>, tensor<10xf32>
    return %logits : tensor<?x10xf32>
  }

  func.func @loss(%input: tensor<?x784xf32>, %labels: tensor<?xi32>) -> tensor<f32> {
    %logits = call @forward(%input) : (tensor<?x784xf32>) -> tensor<?x10xf32>
    %loss = loom.cross_entropy %logits, %labels : tensor<?x10xf32>, tensor<?xi32>
    return %loss : tensor<f32>
  }
}

// Auxiliary losses of blocks inside the model (MoE balancing losses, Mixture-of-Depths'
// router losses): they join the training loss without travelling through the pipeline.
//
// NOTE [auxiliary losses]
// A block returns WithAuxLoss(output, aux, ctx.loss_scale × T), T the micro-batch's tokens:
// the identity on `output` in the forward, and in the backward `aux` receives the gradient
// loss_scale × T — the weight that makes `aux` (a mean over the micro-batch's tokens) count
// as the mean over the global batch, whatever the layout (Megatron's MoEAuxLossAutoScaler
// does the same). Only where `aux` needs a gradient and loss_scale > 0 (training).
#pragma once
#include <ATen/core/Tensor.h>

namespace fulcrum {

/// `output`, carrying `aux` into the backward pass with gradient `scale` (see the NOTE).
at::Tensor WithAuxLoss(const at::Tensor& output, const at::Tensor& aux, double scale);

}  // namespace fulcrum

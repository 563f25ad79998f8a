"""What the methods share (QuantLinear itself, the impl switch and the model walkers: engine/layers.py).

  affine.py        chapter 38's AffineQuantLinear, round-to-nearest (find_params, quantize_to_affine), the packers
  obq.py           the error-feedback loop (OBQ / GPTQ / LDLQ): textbook and lazy-batch, tested equal
  calibration.py   the model walk: a linear's input statistics captured one decoder layer at a time
  input_stats.py   a linear's input statistics (Hessian, mean |x|), summed in a fixed order of slots
  layer_runs.py    one decoder layer run again and again on the calibration batches, reusing what has not changed
  minifloats.py    E4M3, E2M1, E8M0: values and rounding
  hadamard.py      the fast Walsh-Hadamard transform and random rotations
  lattices.py      E8, D4, A2, Z: closest points, integer codes, the strip (HyperQuant's weights and KV cache)
  sensitivity.py   Fisher sensitivities: per weight row from self-generated text, per output channel (a layer
                   at a time) for a planner that knows H
"""

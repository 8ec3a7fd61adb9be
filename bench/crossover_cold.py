"""The packed/dense crossover of the layers' products timed two ways on the default model (default flags):
warm, by `model/quant.py: measure_crossover` given one weight (the first layer's gate_up, on repeat: it
stays in cache; the load's probe until stop 42), and cold, as a step meets the weights (every layer's
gate_up in turn, so each product reads its weight from memory), then what the load measures now
(every layer product in turn); all three by measure_crossover. Milliseconds per product, packed (qmatmul) /
dense copy (GEMM).

Usage: python bench/crossover_cold.py
"""
from pagedserve.engine.llm import LLM
from pagedserve.model.quant import measure_crossover


def main() -> None:
    llm = LLM(num_kv_blocks=64)
    model = llm.engine.model
    gate_ups = [layer.gate_up_proj.weight for layer in model.layers]
    if not hasattr(gate_ups[0], "_qmatmul") or gate_ups[0].dense is None:
        raise SystemExit("the default flags did not give packed weights with dense copies on this host")
    dtype = model.norm.dtype
    print("warm (one layer's gate_up on repeat):", measure_crossover(gate_ups[0], dtype)[1])
    print(f"cold ({len(gate_ups)} layers' gate_up in turn):", measure_crossover(gate_ups, dtype)[1])
    products = [m.weight for layer in model.layers for m in layer.products()]
    print("as at load (every layer product in turn):", measure_crossover(products, dtype)[1])


if __name__ == "__main__":
    main()

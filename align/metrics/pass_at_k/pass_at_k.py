"""pass@k as an `evaluate` metric, loaded from this local folder: align.metrics.load_metric("pass_at_k").

evaluate copies this script into its module cache before importing it, so a relative import
would break there. The math is imported from align.passk as an ordinary library instead: it
works wherever `align` is importable (which it is whenever load_metric is used), and the
estimator stays in one place.
"""

import datasets
import evaluate

from align.passk import mean_pass_at_k

_DESCRIPTION = """
pass@k with the unbiased estimator of Chen et al. (2021): for a problem with n samples of which
c are correct, pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems.
"""

_INPUTS = """
Args:
    predictions: per problem, the number of correct samples c (int).
    references: per problem, the number of samples drawn n (int, >= c).
    k: an int or a list of ints (default [1]).
Returns:
    {"pass@k": float} for each k; None when some problem has fewer than k samples.
Example:
    >>> m = align.metrics.load_metric("pass_at_k")
    >>> m.compute(predictions=[2, 0], references=[5, 5], k=[1, 2])  # pass@1 ~ 0.2, pass@2 ~ 0.35
"""

_CITATION = """
@article{chen2021codex,
  title={Evaluating Large Language Models Trained on Code},
  author={Chen, Mark and others},
  journal={arXiv preprint arXiv:2107.03374},
  year={2021}
}
"""


class PassAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://arxiv.org/abs/2107.03374"],
        )

    def _compute(self, predictions, references, k=(1,)):
        ks = [k] if isinstance(k, int) else list(k)
        return mean_pass_at_k(references, predictions, ks)

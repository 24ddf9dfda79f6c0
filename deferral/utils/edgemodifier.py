"""``Label`` on edges, under Airflow's path ``airflow.utils.edgemodifier``."""

from deferral.authoring.dependencies import EdgeModifier


class Label(EdgeModifier):
    """``branch >> Label("when empty") >> handle_empty``: the label is recorded on each edge
    (``dag.get_edge_info(up, down)["label"]``)."""

    def __init__(self, label: str) -> None:
        super().__init__(label)


__all__ = ["EdgeModifier", "Label"]

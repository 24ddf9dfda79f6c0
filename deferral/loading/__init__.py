"""Loading DAGs: finding and importing the DAGs folder (``dagbag``), the cluster's policies
(``policies``) and Airflow's import paths for unmodified DAG files (``airflow_imports``)."""

"""What the pages and the CLI show: view-models of jobs, plans and memory dashboards."""

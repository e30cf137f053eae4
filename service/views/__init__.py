"""What the pages and the CLI show: view-models of jobs, plans and memory dashboards, and the plan's
table (plan_table.py)."""

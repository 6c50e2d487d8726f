"""Basin's monitoring as code: Grafana dashboards and Prometheus alert rules, generated into the chart."""

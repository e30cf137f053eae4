"""Series rollups and heads: a job's memory and metrics over its whole run read at a bounded cost
(service/jobs/series.py), backfilled for the jobs that exist.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

JSON_ = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table('series_heads',
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('series', sa.String(length=16), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('first_step', sa.Integer(), nullable=False),
    sa.Column('last_step', sa.Integer(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('peaks', JSON_, nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_series_heads_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'attempt', 'series', 'rank', name=op.f('pk_series_heads'))
    )
    op.create_table('series_rollups',
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('series', sa.String(length=16), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('width', sa.Integer(), nullable=False),
    sa.Column('bucket', sa.Integer(), nullable=False),
    sa.Column('first_step', sa.Integer(), nullable=False),
    sa.Column('last_step', sa.Integer(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('stats', JSON_, nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_series_rollups_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'attempt', 'series', 'rank', 'width', 'bucket', name=op.f('pk_series_rollups'))
    )
    _backfill()


def _backfill() -> None:
    """Fold the samples and metrics of every job stored before this revision into its series, so old
    jobs still show their whole run. This one step uses the app's own fold (service/jobs/series.py):
    a second copy of it here could drift from what ingest writes."""
    from sqlalchemy.orm import Session

    from service.jobs import series

    bind = op.get_bind()
    jobs = [r[0] for r in bind.execute(sa.text(
        "SELECT DISTINCT job_id FROM memory_samples UNION SELECT DISTINCT job_id FROM job_events WHERE type = 'metrics'"))]
    session = Session(bind=bind)
    for job_id in jobs:
        series.rebuild(session, job_id)
    session.flush()


def downgrade() -> None:
    op.drop_table('series_rollups')
    op.drop_table('series_heads')
